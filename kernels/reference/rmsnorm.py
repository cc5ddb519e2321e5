"""RMSNorm with the residual add fused in front of it.

Layout: x, residual (T, hidden) rows; weight (hidden,). With a residual the op first forms
s = x + residual (in x's dtype) and normalises s; it returns (normalised, s) so the caller
carries s on as the next residual. The mean square is taken in float32, as the reference
Llama implementation does; the weight multiplies after the cast back to x's dtype.
"""

from __future__ import annotations

import torch


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * s / rms(s), s) with s = x + residual, or s = x without a residual."""
    s = x if residual is None else x + residual
    s32 = s.float()
    s32 = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * s32.to(s.dtype), s
