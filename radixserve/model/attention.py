"""The one attention interface the model calls; backends are registered by name.

A step's tokens are flattened into one (T, ...) batch. `AttentionMetadata` is built once
per step (`radixserve.model.forward_batch`, one host-to-device copy) and serves every
layer alike: where new K/V go and which tokens attend to what.

    tokens:  [ extend seq 0 (n0 tokens) | extend seq 1 (n1) | ... | decode 0 | decode 1 | ... ]
    seqs:      0                          1                        E          E + 1
               rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of the step are sequence b's

Sequences [0, num_extends) have several new tokens and go to `extend_attention`; the rest
have one each and go to `decode_attention`. A backend is a kernel set (`KernelOps`): it
stores the layer's new K/V, then runs those two kernels on their parts of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from radixserve.errors import ConfigurationError
from radixserve.kernels.ops import KernelOps, load_ops, resolve_backend


@dataclass(frozen=True)
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # (B + 1,) int64 start of each sequence's new tokens in the step
    prefix_lens: torch.Tensor  # (B,) int64 tokens already in the pages before them
    seq_lens: torch.Tensor  # (B,) int64 prefix + new tokens; 0 for a padding row
    page_table: torch.Tensor  # (B, W) int64 each sequence's pages, zero-padded
    slot_mapping: torch.Tensor  # (T,) int64 flat slot (page * page_size + offset); -1 = none
    num_extends: int  # sequences [0, num_extends) have more than one new token
    num_extend_tokens: int  # their tokens: rows [0, num_extend_tokens) of the step
    max_query_len: int  # most new tokens of one extend (sizes the extend grid)
    max_seq_len: int  # longest seq_len (sizes decode splits; no device sync)


class AttentionBackend:
    """Paged attention for one layer at a time, on one kernel set.

    Contract: `forward` first stores k/v at `meta.slot_mapping` in the caches, then returns
    (T, H, D) where each token attends causally to its sequence's earlier tokens (from the
    cache) and to itself; with a sliding `window` w > 0 only to its last w positions,
    itself included (a local layer). Scores are q k^T * `scale` (None: 1 / sqrt(D)). It
    touches no cache slot outside slot_mapping.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self.ops: KernelOps = load_ops(self.name)

    def num_splits(self, num_decodes: int, num_kv_heads: int, max_seq_len: int) -> int | None:
        """How many pieces the decode kernel cuts each context into (None: its default)."""
        return None

    def forward(
        self,
        q: torch.Tensor,  # (T, H, D)
        k: torch.Tensor,  # (T, H_kv, D)
        v: torch.Tensor,  # (T, H_kv, D)
        k_cache: torch.Tensor,  # (num_pages, page_size, H_kv, D)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int = 0,
        scale: float | None = None,
    ) -> torch.Tensor:
        ops = self.ops
        ops.store_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        e, et = meta.num_extends, meta.num_extend_tokens
        parts = []
        if e:
            parts.append(
                ops.extend_attention(
                    q[:et],
                    k_cache,
                    v_cache,
                    meta.cu_seqlens_q[: e + 1],
                    meta.prefix_lens[:e],
                    meta.page_table[:e],
                    meta.max_query_len,
                    window=window,
                    scale=scale,
                )  # fmt: skip
            )
        if et < q.shape[0]:
            # a local layer's query sees at most `window` keys: split that many, not more
            reach = min(meta.max_seq_len, window) if window else meta.max_seq_len
            splits = self.num_splits(q.shape[0] - et, k_cache.shape[2], reach)
            parts.append(
                ops.decode_attention(
                    q[et:],
                    k_cache,
                    v_cache,
                    meta.page_table[e:],
                    meta.seq_lens[e:],
                    splits,
                    window=window,
                    scale=scale,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class TorchAttention(AttentionBackend):
    """The reference kernels: SDPA per extend sequence, one padded SDPA for all decodes."""

    name = "torch"


class TritonAttention(AttentionBackend):
    """Paged Triton kernels: flash-style extend, split-K decode."""

    name = "triton"

    def __init__(self, num_units: int) -> None:
        super().__init__()
        self.num_units = num_units  # compute units (SMs) the decode grid should fill

    def num_splits(self, num_decodes: int, num_kv_heads: int, max_seq_len: int) -> int | None:
        from radixserve.kernels.triton.decode_attention import default_num_splits

        return default_num_splits(num_decodes, num_kv_heads, max_seq_len, self.num_units)


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend for the `attention_backend` setting on `device` ("auto" resolved here,
    once per engine; its kernel set is imported only now)."""
    try:
        resolved = resolve_backend(name, device.type)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    if resolved == TritonAttention.name:
        on_gpu = device.type == "cuda"
        units = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 4
        return TritonAttention(units)
    return TorchAttention()
