"""Rotary position embedding in place on q and k (Triton).

Layout as `radixserve.kernels.reference.rope`: q (T, H, D), k (T, H_kv, D) with unit
stride in D (views into the fused qkv output are fine), positions (T,), cos/sin tables
(max_positions, D // 2) float32. One program per token rotates all its q and k heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.triton.checks import block, check_index, check_same_dtype, check_tensor


@triton.jit
def _rotate(x_ptr, stride_h, c, s, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (d < HALF)
    ptr1 = x_ptr + h * stride_h + d
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(ptr1, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(ptr1 + HALF, (b * c + a * s).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    c = tl.load(cos_ptr + pos * HALF + d, mask=d < HALF, other=0.0)  # (1, BLOCK_HALF)
    s = tl.load(sin_ptr + pos * HALF + d, mask=d < HALF, other=0.0)
    _rotate(q_ptr + t * stride_qt, stride_qh, c, s, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate(k_ptr + t * stride_kt, stride_kh, c, s, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate q and k in place by their tokens' positions."""
    op = "rope"
    check_tensor(op, "q", q, (None, None, None))
    tokens, _, dim = q.shape
    if dim % 2:
        raise ValueError(f"{op}: head_dim {dim} must be even")
    check_tensor(op, "k", k, (tokens, None, dim))
    check_same_dtype(op, q=q, k=k)
    check_index(op, "positions", positions, (tokens,))
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(op, name, table, (None, dim // 2), (torch.float32,))
        if not table.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
    if tokens == 0:
        return
    _rope_kernel[(tokens,)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], HALF=dim // 2,
        BLOCK_QH=block(q.shape[1]), BLOCK_KH=block(k.shape[1]), BLOCK_HALF=block(dim // 2),
    )  # fmt: skip
