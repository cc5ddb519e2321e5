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
    c = cos.index_select(0, positions)  # (T, D/2)
    s = sin.index_select(0, positions)
    # As whole-row factors: x' = x * (c, c) + (x2, x1) * (-s, s)
    cos_row = torch.cat([c, c], dim=-1)[:, None, :]  # (T, 1, D)
    sin_row = torch.cat([-s, s], dim=-1)[:, None, :]
    half = c.shape[-1]
    for x in (q, k):
        if x.dtype == torch.float32:  # in place, three ops: the CPU hot path
            swapped = x.roll(half, dims=-1)
            x.mul_(cos_row).addcmul_(swapped, sin_row)
        else:
            x32 = x.float()
            x.copy_(x32 * cos_row + x32.roll(half, dims=-1) * sin_row)
