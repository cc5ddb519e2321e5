"""The quantized GEMM's specification: the exact product of bfloat16 x and the weight its
codes and scales stand for, in float64.

`cpu/qgemm.c` computes it to within one bfloat16 rounding of its output (float32 sums of
exact products, in a fixed order per output row). Layouts as the kernel takes them before
packing:

    x             (T, K) bfloat16
    q             (N, K) codes: uint8 0..15 (int4) or int8
    scales_zeros  (K / group, N, 2) bfloat16: w = (q - 8) * scale + zero   (int4)
    scale         (N,) bfloat16: w = q * scale                               (int8)
"""

from __future__ import annotations

import torch


def int4_weight(q: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The (N, K) float64 weight of int4 codes with per-group scales and zeros."""
    n, k = q.shape
    scale = scales_zeros[..., 0].double().t().repeat_interleave(group, dim=1)  # (N, K)
    zero = scales_zeros[..., 1].double().t().repeat_interleave(group, dim=1)
    return (q.double() - 8) * scale + zero


def int8_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The (N, K) float64 weight of int8 codes with one scale per row."""
    return q.double() * scale.double()[:, None]


def exact_product(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ w.T, |x| @ |w|.T), both (T, N) float64: the product and the magnitude its
    float32 sums round against."""
    x64 = x.double()
    return x64 @ w.t(), x64.abs() @ w.abs().t()
