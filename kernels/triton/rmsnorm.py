"""RMSNorm with the residual add fused in front of it (Triton).

Layout as `radixserve.kernels.reference.rmsnorm`: x, residual (T, hidden), weight (hidden,);
returns (normalised, x + residual). One program per row holds the whole row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.triton.checks import block, check_same_dtype, check_tensor, num_warps


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # the sum is rounded to the input dtype, as the unfused add would be
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * HIDDEN + cols, x, mask=mask)
    s = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / HIDDEN + eps)
    normed = (s * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + cols, (w * normed).to(x.dtype), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * s / rms(s), s) with s = x + residual, or s = x without a residual."""
    op = "rmsnorm"
    check_tensor(op, "x", x, (None, None))
    rows, hidden = x.shape
    check_tensor(op, "weight", weight, (hidden,))
    check_same_dtype(op, x=x, weight=weight)
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)  # (T, hidden)
    total = x
    if residual is not None:
        check_tensor(op, "residual", residual, (rows, hidden))
        check_same_dtype(op, x=x, residual=residual)
        total = torch.empty_like(out)
    if rows:
        _rmsnorm_kernel[(rows,)](
            x, x if residual is None else residual, weight, out, total,
            x.stride(0), x.stride(0) if residual is None else residual.stride(0), eps,
            HIDDEN=hidden, BLOCK=block(hidden), HAS_RESIDUAL=residual is not None,
            num_warps=num_warps(block(hidden)),
        )  # fmt: skip
    return out, total
