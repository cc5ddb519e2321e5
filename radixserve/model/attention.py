"""The one attention interface the model calls; backends are registered by name.

A step's tokens are flattened into one (T, ...) batch. `AttentionMetadata` is built once
per step by the model runner and says, for every layer alike, where new K/V go and which
tokens attend to what:

    tokens:  [ prefill seq 0 (n0 tokens) | prefill seq 1 (n1) | ... | decode 0 | decode 1 ... ]
              └─ PrefillSpan(start, end, prefix_len, page_ids)   └─ DecodeBatch rows

A backend gets one layer's q/k/v and that layer's (K, V) page caches, writes the new
K/V, and returns the attention output for all T tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from radixserve.kernels.reference import paged_attention as ref


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence's new tokens [start, end) in the step, after `prefix_len` cached ones."""

    start: int
    end: int
    prefix_len: int
    page_ids: torch.Tensor  # (ceil((prefix_len + end - start) / page_size),) int64


@dataclass(frozen=True)
class DecodeBatch:
    """Sequences that add one token each; their tokens are [start, start + B) of the step."""

    start: int
    page_table: torch.Tensor  # (B, max_pages) int64, padded with page 0
    context_lens: torch.Tensor  # (B,) int64, the new token included


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64 flat slot (page * page_size + offset) per token
    prefills: tuple[PrefillSpan, ...]
    decode: DecodeBatch | None


class AttentionBackend(ABC):
    """Paged attention for one layer at a time.

    Contract: `forward` first stores k/v at `meta.slot_mapping` in the caches, then returns
    (T, H, D) where each token attends causally to its sequence's earlier tokens (from the
    cache) and to itself. It must not touch cache slots other than those in slot_mapping.
    """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (T, H, D)
        k: torch.Tensor,  # (T, H_kv, D)
        v: torch.Tensor,  # (T, H_kv, D)
        k_cache: torch.Tensor,  # (num_pages, page_size, H_kv, D)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


class TorchAttention(AttentionBackend):
    """The reference kernels: SDPA per prefill sequence, one padded SDPA for all decodes."""

    def forward(self, q, k, v, k_cache, v_cache, meta):
        ref.write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        for span in meta.prefills:
            s, e = span.start, span.end
            out[s:e] = ref.prefill_attention(
                q[s:e], k[s:e], v[s:e], k_cache, v_cache, span.page_ids, span.prefix_len
            )
        if meta.decode is not None:
            d = meta.decode
            b = d.page_table.shape[0]
            out[d.start : d.start + b] = ref.decode_attention(
                q[d.start : d.start + b], k_cache, v_cache, d.page_table, d.context_lens
            )
        return out


_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention}


def make_attention_backend(name: str) -> AttentionBackend:
    """The backend registered under `name` (the `attention_backend` setting)."""
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}"
        ) from None
