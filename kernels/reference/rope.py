"""Rotary position embedding, in place on q and k (Hugging Face rotate-half form).

Layout: q (T, H, D), k (T, H_kv, D), last dim contiguous (views into the fused qkv
projection are fine); positions (T,) int64; cos, sin (max_positions, D // 2) float32 tables
built from the checkpoint's theta and scaling (`radixserve.model.rope`). For each head,
with x1 = x[:D/2], x2 = x[D/2:] and angle table row p = positions[t]:

    x1' = x1 cos - x2 sin        x2' = x2 cos + x1 sin      (computed in float32)
"""

from __future__ import annotations

import torch


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate q and k in place by their tokens' positions."""
    c = cos.index_select(0, positions)[:, None, :]  # (T, 1, D/2)
    s = sin.index_select(0, positions)[:, None, :]
    for x in (q, k):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        x.copy_(rotated)
