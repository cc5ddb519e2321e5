"""The gated MLP's activation silu(gate) * up (Triton).

Layout as `radixserve.kernels.reference.silu_and_mul`: x (T, 2 * I) → (T, I); computed in
float32, rounded once. Program (row, chunk) handles BLOCK columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.triton.checks import block, check_tensor

_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * up.to(tl.float32)
    tl.store(out_ptr + row * INTER + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    op = "silu_and_mul"
    check_tensor(op, "x", x, (None, None))
    rows, width = x.shape
    if width % 2:
        raise ValueError(f"{op}: x has {width} columns; expected an even number (gate | up)")
    inter = width // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)  # (T, I)
    if rows and inter:
        bs = block(min(inter, _MAX_BLOCK))
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, bs))](
            x, out, x.stride(0), INTER=inter, BLOCK=bs
        )
    return out
