"""Compatibility descriptor of a KV pool: what two peers must agree on to swap pages.

Two pools can exchange pages only if a page means the same bytes on both sides: the
same weights (model name), dtype, layer count, KV heads, head dim, page size and memory
layout. The number of pages may differ. `PoolCompat.digest` is a stable sha256 of a
canonical encoding, so peers compare one string before the first transfer (and the ZMQ
backend repeats it in every request).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

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

    @classmethod
    def of(cls, kv: torch.Tensor, model_name: str) -> PoolCompat:
        """Describe the pool tensor ``kv`` (L, 2, P, S, H, D), whose weights are named
        ``model_name`` (`ModelConfig.name`)."""
        num_layers, kinds, _, page_size, num_kv_heads, head_dim = kv.shape
        assert kinds == 2, f"not a KV pool tensor: shape {tuple(kv.shape)}"
        return cls(
            model_name=model_name,
            dtype=dtype_name(kv.dtype),
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
        )

    @property
    def region_bytes(self) -> int:
        """One page of one layer's K (or V): a contiguous run in the pool, the unit a
        transfer descriptor names."""
        element = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.page_size * self.num_kv_heads * self.head_dim * element

    @property
    def page_bytes(self) -> int:
        """One page across every layer, K and V: what a page costs in any tier."""
        return 2 * self.num_layers * self.region_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain, msgpack/JSON-encodable form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolCompat:
        """Inverse of `to_dict`; raises ValueError on missing or unknown fields."""
        names = {f.name for f in fields(cls)}
        if set(data) != names:
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

    def check_tensor(self, kv: torch.Tensor) -> None:
        """Raise ValueError unless `kv` is a contiguous pool tensor of this shape/dtype."""
        if kv.dim() != 6 or kv.shape[1] != 2:
            raise ValueError(f"expected a (L, 2, P, S, H, D) pool tensor, got {tuple(kv.shape)}")
        want = (self.num_layers, self.page_size, self.num_kv_heads, self.head_dim)
        got = (kv.shape[0], kv.shape[3], kv.shape[4], kv.shape[5])
        if want != got:
            raise ValueError(f"pool tensor (L, S, H, D) {got} does not match compat {want}")
        if dtype_name(kv.dtype) != self.dtype:
            raise ValueError(f"pool dtype {kv.dtype} does not match compat {self.dtype}")
        if not kv.is_contiguous():
            raise ValueError("pool tensor must be contiguous (it is registered as one region)")
