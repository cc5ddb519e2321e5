"""Which KV heads each rank of a tensor-parallel worker's pool holds, and which pools of
different TP sizes can exchange pages (`radixserve.transfer.compat` has the layout; this
module needs no torch, so the gateway's link checks can use it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVShard:
    """The KV heads [first, first + count) of the model that one pool holds: rank ``rank``
    of a worker of tensor-parallel size ``size`` (a whole pool: size 1, every head)."""

    size: int
    rank: int
    first: int
    count: int

    @classmethod
    def whole(cls, num_kv_heads: int) -> KVShard:
        """A pool holding every one of the model's ``num_kv_heads``."""
        return cls(1, 0, 0, num_kv_heads)

    @property
    def heads(self) -> range:
        return range(self.first, self.first + self.count)

    def to_list(self) -> list[int]:
        return [self.size, self.rank, self.first, self.count]

    @classmethod
    def from_list(cls, data: Sequence[int]) -> KVShard:
        size, rank, first, count = (int(x) for x in data)
        if not (0 <= rank < size and first >= 0 and count >= 1):
            raise ValueError(f"bad KV shard {list(data)}")
        return cls(size, rank, first, count)


def tp_pair_error(ours: int, theirs: int) -> str:
    """Why pools of tensor-parallel sizes ``ours`` and ``theirs`` cannot exchange pages
    ("" when they can: equal sizes, or one divides the other)."""
    if max(ours, theirs) % min(ours, theirs) == 0:
        return ""
    return (f"KV pages move between tensor-parallel sizes only when one divides the other: "
            f"this side is TP={ours}, the peer TP={theirs}")  # fmt: skip


def head_sources(mine: KVShard, theirs: Sequence[KVShard]) -> list[tuple[int, range]]:
    """Where the heads of ``mine`` are read from: (index into ``theirs``, model heads),
    each head from one peer rank, consecutive heads from the same rank together. A head
    several peer ranks hold (replicated KV heads) is read from the one ``mine.rank``
    picks, so a reading worker's ranks spread over them. ValueError if a head is held by
    none."""
    reads: list[tuple[int, range]] = []
    for head in mine.heads:
        holders = [i for i, shard in enumerate(theirs) if head in shard.heads]
        if not holders:
            raise ValueError(f"no peer rank holds KV head {head}")
        source = holders[mine.rank % len(holders)]
        if reads and reads[-1][0] == source and reads[-1][1].stop == head:
            reads[-1] = (source, range(reads[-1][1].start, head + 1))
        else:
            reads.append((source, range(head, head + 1)))
    return reads
