"""Compatibility descriptor of a KV pool: what two peers must agree on to swap pages.

Two pools can exchange pages only if a page means the same bytes on both sides: the
same model identity (`radixserve.model.identity.ModelIdentity`: weights fingerprint,
quantization, compute dtype, adapter; ``identity`` holds its digest), model name, KV
dtype, layer count, KV heads, head dim, page size and memory layout. The number of pages
may differ. `PoolCompat.digest` is a stable sha256 of a
canonical encoding, so peers compare one string before the first transfer (and the ZMQ
backend repeats it in every request).

Tensor parallelism: a worker of TP size N keeps its pool split over its N ranks, each
rank's pool holding some of the model's KV heads (`radixserve.transfer.shards.KVShard`);
`PoolCompat` describes the model's whole page (its ``num_kv_heads`` are the model's), so pools of any TP size share
one digest, and the host tier, whose pages are whole, is simply TP size 1. Pages move
between TP sizes only when one divides the other (`tp_pair_error`); a rank then reads,
from each rank of the peer that holds some of its heads, exactly those heads
(`head_sources`). In the pool's (page, slot, head, dim) layout a head slice of a page is
``page_size`` runs of ``heads * head_dim`` elements, one per slot, all read in the same
single transfer. The layout that would make it one run, (page, head, slot, dim), costs
the CPU's decode attention 2-4x on one sequence's 1k-16k-token context (it can no longer
attend a run of pages in place; ``kernels/bench_cpu_decode.py --layouts``), so it is not
used (docs/architecture.md §3).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

import torch

from radixserve.transfer.shards import KVShard

#: Layout of the KV pool tensor (`radixserve.cache.kv_pool`): (layer, kind=K/V, page, slot, kv_head, head_dim).
POOL_LAYOUT = "L2PSHD"
_ENCODING_VERSION = "radixserve.kv-compat.v1"


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> "float32": the spelling used in descriptors."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PoolCompat:
    """The properties of a pool that make its pages interchangeable with a peer's."""

    model_name: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    layout: str = POOL_LAYOUT
    identity: str = ""  # `ModelIdentity.digest` of the weights ("": not stated)

    @classmethod
    def of(
        cls, kv: torch.Tensor, model_name: str, num_kv_heads: int | None = None,
        identity: str = "",
    ) -> PoolCompat:  # fmt: skip
        """Describe the pool tensor ``kv`` (L, 2, P, S, H, D), whose weights are named
        ``model_name`` (`ModelConfig.name`), have ``num_kv_heads`` KV heads (default:
        H, a pool holding every head) and the identity of digest ``identity``."""
        num_layers, kinds, _, page_size, heads, head_dim = kv.shape
        assert kinds == 2, f"not a KV pool tensor: shape {tuple(kv.shape)}"
        return cls(
            model_name=model_name,
            dtype=dtype_name(kv.dtype),
            num_layers=num_layers,
            num_kv_heads=num_kv_heads or heads,
            head_dim=head_dim,
            page_size=page_size,
            identity=identity,
        )

    @property
    def region_bytes(self) -> int:
        """One page of one layer's K (or V), every head: a contiguous run in a whole pool,
        the unit a transfer descriptor names."""
        element = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.page_size * self.num_kv_heads * self.head_dim * element

    @property
    def page_bytes(self) -> int:
        """One page across every layer, K and V, every head: what a page costs in any
        tier (over all the ranks of a tensor-parallel worker)."""
        return 2 * self.num_layers * self.region_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain, msgpack/JSON-encodable form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolCompat:
        """Inverse of `to_dict`; raises ValueError on unknown fields or missing ones
        without a default (a descriptor written before ``identity`` existed reads as
        identity "", which equals no stated identity)."""
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        if not required <= set(data) <= names:
            raise ValueError(f"compat descriptor fields {sorted(data)} != {sorted(names)}")
        return cls(**data)

    @property
    def digest(self) -> str:
        """sha256 hex of the canonical encoding; equal iff every field is equal."""
        canonical = json.dumps(
            [_ENCODING_VERSION, self.to_dict()], sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def mismatches(self, other: PoolCompat) -> list[str]:
        """Human-readable "field: ours != theirs" for every field that differs."""
        ours, theirs = self.to_dict(), other.to_dict()
        return [f"{k}: {ours[k]!r} != {theirs[k]!r}" for k in ours if ours[k] != theirs[k]]

    def check_tensor(self, kv: torch.Tensor, shard: KVShard | None = None) -> None:
        """Raise ValueError unless `kv` is a contiguous pool tensor of this shape/dtype
        holding the heads of ``shard`` (default: every head)."""
        if kv.dim() != 6 or kv.shape[1] != 2:
            raise ValueError(f"expected a (L, 2, P, S, H, D) pool tensor, got {tuple(kv.shape)}")
        heads = self.num_kv_heads if shard is None else shard.count
        want = (self.num_layers, self.page_size, heads, self.head_dim)
        got = (kv.shape[0], kv.shape[3], kv.shape[4], kv.shape[5])
        if want != got:
            raise ValueError(f"pool tensor (L, S, H, D) {got} does not match compat {want}")
        if dtype_name(kv.dtype) != self.dtype:
            raise ValueError(f"pool dtype {kv.dtype} does not match compat {self.dtype}")
        if not kv.is_contiguous():
            raise ValueError("pool tensor must be contiguous (it is registered as one region)")
