"""The memory floor of a decode step: the bytes it must read over the machine's copy
bandwidth, measured in the same run.

A decode step reads every weight once (as loaded: int4/int8 matrices with their scales,
the embedding and LM head in their own dtype) and the KV of every running sequence's
context. On a CPU at small batches that is the step's cost; the ratio of a measured
step time to this floor says how far from memory-bound a server is.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


def copy_gbs() -> float:
    """Bytes read and written per second by a 256 MiB copy (best of 5), in GB/s."""
    src = torch.ones(64 << 20)  # (64 Mi,) float32: 256 MiB, far past any cache
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV bytes one token of context holds: K and V in every layer."""
    return num_layers * 2 * num_kv_heads * head_dim * dtype_bytes


def floor_ms(weight_bytes: int, kv_bytes: float, gbs: float) -> float:
    """Milliseconds to read ``weight_bytes + kv_bytes`` at ``gbs`` GB/s."""
    return (weight_bytes + kv_bytes) / (gbs * 1e9) * 1e3


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor of a GGUF file as stored (what llama.cpp reads)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
