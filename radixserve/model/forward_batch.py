"""One step's model inputs, built on the host and moved to the device in a single copy.

The model runner describes each sequence's share of the step as a `SequenceChunk`;
`build_forward_batch` packs them into one int64 host buffer, copies it to the device once
and hands out views::

    [ input_ids T | positions T | slot_mapping T | logits_indices N |
      cu_seqlens_q B+1 | prefix_lens B | seq_lens B | page_table B*W ]

    T tokens, N rows that want logits, B sequences, W = page-table width

Sequences with several new tokens (extends) come first, one-token sequences (decodes)
after them. Padding (for CUDA-graph buckets) appends one-token rows that write nowhere
(slot -1) and see nothing (seq_len 0).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.model.attention import AttentionMetadata


@dataclass(frozen=True)
class SequenceChunk:
    """A sequence's new tokens this step, after `prefix_len` tokens already in its pages."""

    token_ids: Sequence[int]
    prefix_len: int
    page_ids: Sequence[int]  # the sequence's pages, covering at least prefix_len + new tokens
    wants_logits: bool  # its last new token samples the next one
    scored_rows: int = 0  # its first k new tokens also want logits (prompt logprobs)


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    # (N,) int64 rows of T whose next-token logits are wanted: each chunk's last token
    # that wants them, in chunk order, then each chunk's scored rows, in chunk order
    logits_indices: torch.Tensor
    attn: AttentionMetadata
    # (T,) int64: each row's LoRA adapter slot, -1 for the base model; None when no row
    # has an adapter (`radixserve.model.lora_manager.LoraBatch`, set by the model runner)
    lora_slots: torch.Tensor | None = None


def buffer_len(tokens: int, logits: int, seqs: int, width: int) -> int:
    """Elements of the packed buffer for those sizes."""
    return 3 * tokens + logits + 3 * seqs + 1 + seqs * width


class _HostStep:
    """The step's index lists, filled chunk by chunk, then packed into one tensor."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.logits_rows: list[int] = []
        self.scored_rows: list[int] = []
        self.cu: list[int] = [0]
        self.prefix_lens: list[int] = []
        self.seq_lens: list[int] = []
        self.rows: list[Sequence[int]] = []
        self.num_extends = self.num_extend_tokens = self.max_query_len = 0

    def add(self, c: SequenceChunk, wants_logits: bool) -> None:
        ps, n, lo = self.ps, len(c.token_ids), c.prefix_len
        hi = lo + n
        if n > 1:
            assert self.num_extends == len(self.seq_lens), "extends must come before decodes"
            self.num_extends += 1
            self.num_extend_tokens += n
            self.max_query_len = max(self.max_query_len, n)
        self.scored_rows.extend(range(len(self.ids), len(self.ids) + c.scored_rows))
        self.ids.extend(c.token_ids)
        self.positions.extend(range(lo, hi))
        self.slots.extend(c.page_ids[p // ps] * ps + p % ps for p in range(lo, hi))
        if wants_logits:
            self.logits_rows.append(len(self.ids) - 1)
        self.cu.append(len(self.ids))
        self.prefix_lens.append(lo)
        self.seq_lens.append(hi)
        self.rows.append(c.page_ids[: -(-hi // ps)])

    def add_padding(self) -> None:
        """A decode row that writes no KV (slot -1) and sees nothing (seq_len 0)."""
        self.logits_rows.append(len(self.ids))
        self.ids.append(0)
        self.positions.append(0)
        self.slots.append(-1)
        self.cu.append(len(self.ids))
        self.prefix_lens.append(0)
        self.seq_lens.append(0)
        self.rows.append(())

    def pack(self, width: int) -> tuple[torch.Tensor, list[int]]:
        """The one int64 host tensor, and the lengths of its sections in order."""
        table: list[int] = []
        for r in self.rows:
            table.extend(r)
            table.extend([0] * (width - len(r)))
        logits = self.logits_rows + self.scored_rows
        sections = [self.ids, self.positions, self.slots, logits, self.cu,
                    self.prefix_lens, self.seq_lens, table]  # fmt: skip
        flat = list(itertools.chain.from_iterable(sections))
        return torch.tensor(flat, dtype=torch.int64), [len(x) for x in sections]


@dataclass(frozen=True)
class PackedStep:
    """A step's inputs on the host: the one int64 buffer and what its sections are. Its
    `header` (a fixed number of ints) and the buffer are all a tensor-parallel rank is
    sent to rebuild the same `ForwardBatch` (`from_header`)."""

    host: torch.Tensor  # (buffer_len,) int64
    sizes: tuple[int, ...]  # the 8 sections' lengths, in buffer order
    num_seqs: int
    width: int  # page-table width
    num_extends: int
    num_extend_tokens: int
    max_query_len: int
    max_seq_len: int

    HEADER_LEN = 14

    def header(self) -> list[int]:
        return [*self.sizes, self.num_seqs, self.width, self.num_extends,
                self.num_extend_tokens, self.max_query_len, self.max_seq_len]  # fmt: skip

    @classmethod
    def from_header(cls, header: Sequence[int], host: torch.Tensor) -> PackedStep:
        h = [int(x) for x in header]
        assert len(h) == cls.HEADER_LEN and sum(h[:8]) == host.numel(), (h, host.numel())
        return cls(host, tuple(h[:8]), *h[8:])


def pack_step(
    chunks: Sequence[SequenceChunk],
    page_size: int,
    pad_to: int | None = None,
    table_width: int | None = None,
) -> PackedStep:
    """Pack `chunks` (extends first) into one host buffer (see `build_forward_batch`)."""
    step = _HostStep(page_size)
    for c in chunks:
        step.add(c, c.wants_logits or pad_to is not None)
    if pad_to is not None:
        assert step.num_extends == 0 and len(chunks) <= pad_to, "only decodes are padded"
        assert not step.scored_rows, "padded rows' logits are in row order: nothing scored"
        for _ in range(pad_to - len(chunks)):
            step.add_padding()
    width = max((len(r) for r in step.rows), default=0) if table_width is None else table_width
    host, sizes = step.pack(width)
    return PackedStep(
        host, tuple(sizes), len(step.seq_lens), width, step.num_extends,
        step.num_extend_tokens, step.max_query_len,
        max(step.seq_lens, default=0) if table_width is None else width * page_size,
    )  # fmt: skip


def forward_batch_of(
    packed: PackedStep, device: torch.device, out: torch.Tensor | None = None
) -> ForwardBatch:
    """Device views of a packed step (copied once; into ``out`` when given)."""
    if out is not None:
        out.copy_(packed.host, non_blocking=True)
        buf = out
    else:
        host = packed.host
        buf = host if device.type == "cpu" else host.to(device, non_blocking=True)
    ids, positions, slots, logits, cu, prefix_lens, seq_lens, table = buf.split(packed.sizes)
    meta = AttentionMetadata(
        cu_seqlens_q=cu,
        prefix_lens=prefix_lens,
        seq_lens=seq_lens,
        page_table=table.view(packed.num_seqs, packed.width),
        slot_mapping=slots,
        num_extends=packed.num_extends,
        num_extend_tokens=packed.num_extend_tokens,
        max_query_len=packed.max_query_len,
        max_seq_len=packed.max_seq_len,
    )
    return ForwardBatch(input_ids=ids, positions=positions, logits_indices=logits, attn=meta)


def build_forward_batch(
    chunks: Sequence[SequenceChunk],
    page_size: int,
    device: torch.device,
    pad_to: int | None = None,
    table_width: int | None = None,
    out: torch.Tensor | None = None,
) -> ForwardBatch:
    """Pack `chunks` (extends first) into one buffer and return device views of it.

    pad_to: append padding decode rows up to this many sequences; every row (padding
    included) then has logits, in row order. table_width: a fixed page-table width (and
    max_seq_len becomes its reach). out: a device buffer of exactly `buffer_len` elements
    to copy into (a CUDA graph's static input); otherwise a new one is made.
    """
    return forward_batch_of(pack_step(chunks, page_size, pad_to, table_width), device, out)
