"""The batched LoRA matmul (Triton): each row adds its own adapter's low-rank update to a
projection's output, or nothing (slot -1, the base model).

Layout as `radixserve.kernels.reference.lora`: x (N, K), y (N, M) (a column slice of a
wider output is fine), a (L, R, K), b (L, M, R) (any strides in M and R), row_slot
(N,), scaling (L,). Two launches, gathered per row (each program reads its row's slot,
so rows of different adapters and base rows mix freely):

- shrink, a program per row: t = a[s] @ x[i], rounded to x's dtype, into a (N, R)
  float32 scratch;
- expand, a program per (row, BLOCK_M columns): y[i] += scaling[s] * b[s] @ t, rounded.

Every dot product adds in the reference's fixed order (`reference/lora.py`): 16 lanes,
one step of 16 terms at a time, then halved 16 -> 8 -> 4 -> 2 -> 1 (each halving a sum
over an axis of two, which has one order), with multiplies never fused into adds
(`enable_fp_fusion=False`). So the result is the reference's bit for bit, and no row
depends on another. Slots are not read on the host (no sync; CUDA-graph safe): a row
whose slot is outside [0, L) is left alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.triton.checks import block, check_index, check_same_dtype, check_tensor

LANES: tl.constexpr = tl.constexpr(16)  # partial sums per dot product (reference.lora.LANES)
_BLOCK_M = 64  # output columns per program of the expand
_MAX_RANK = 256


@triton.jit
def _halve(lanes, ROWS: tl.constexpr):
    """(ROWS, 16) lanes -> (ROWS,): lane[j] += lane[j + half] for half = 8, 4, 2, 1."""
    lanes = tl.sum(tl.reshape(lanes, (ROWS, 2, 8)), axis=1)
    lanes = tl.sum(tl.reshape(lanes, (ROWS, 2, 4)), axis=1)
    lanes = tl.sum(tl.reshape(lanes, (ROWS, 2, 2)), axis=1)
    return tl.sum(tl.reshape(lanes, (ROWS, 2, 1)), axis=1).reshape((ROWS,))


@triton.jit
def _round(v, BF16: tl.constexpr):
    """float32 v rounded to the operands' dtype (bfloat16: nearest, ties to even), kept in
    float32. Written out in bits: Triton's interpreter truncates in its own cast, a GPU
    rounds; these bits are the same in both, and the cast to bfloat16 after is exact."""
    if BF16:
        u = v.to(tl.uint32, bitcast=True)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        v = tl.where(v != v, v, u.to(tl.float32, bitcast=True))  # NaN stays NaN
    return v


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, t_ptr, stride_x, stride_as, stride_ar, num_slots,
    K: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    ranks = tl.arange(0, BLOCK_R)
    lanes = tl.zeros((BLOCK_R, LANES), dtype=tl.float32)
    for k0 in range(0, K, LANES):
        ks = k0 + tl.arange(0, LANES)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0)
        a = tl.load(
            a_ptr + slot * stride_as + ranks[:, None] * stride_ar + ks[None, :],
            mask=(ranks[:, None] < R) & (ks[None, :] < K),
            other=0.0,
        )  # (BLOCK_R, 16)
        lanes = lanes + a.to(tl.float32) * x.to(tl.float32)[None, :]
    t = _round(_halve(lanes, BLOCK_R), BF16)  # (BLOCK_R,) float32, rounded to x's dtype
    tl.store(t_ptr + row * R + ranks, t, mask=ranks < R)


@triton.jit
def _lora_expand_kernel(
    t_ptr, b_ptr, y_ptr, slot_ptr, scale_ptr, stride_y, stride_bs, stride_bm, stride_br,
    num_slots, M: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    lanes = tl.zeros((BLOCK_M, LANES), dtype=tl.float32)
    for r0 in range(0, R, LANES):
        rs = r0 + tl.arange(0, LANES)
        t = tl.load(t_ptr + row * R + rs, mask=rs < R, other=0.0)  # (16,) float32
        b = tl.load(
            b_ptr + slot * stride_bs + cols[:, None] * stride_bm + rs[None, :] * stride_br,
            mask=(cols[:, None] < M) & (rs[None, :] < R),
            other=0.0,
        )  # (BLOCK_M, 16)
        lanes = lanes + b.to(tl.float32) * t[None, :]
    delta = tl.load(scale_ptr + slot) * _halve(lanes, BLOCK_M)
    y = tl.load(y_ptr + row * stride_y + cols, mask=cols < M, other=0.0)
    out = _round(y.to(tl.float32) + delta, BF16).to(y.dtype)
    tl.store(y_ptr + row * stride_y + cols, out, mask=cols < M)


def lora_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slot: torch.Tensor,
    scaling: torch.Tensor,
) -> None:
    """As `reference.lora.lora_apply`: y[i] += scaling[s] * (b[s] @ (a[s] @ x[i])) for each
    row i with s = row_slot[i] >= 0, in place on y (N, M)."""
    op = "lora_apply"
    dtypes = (torch.bfloat16, torch.float32)
    check_tensor(op, "x", x, (None, None), dtypes)
    rows, k = x.shape
    check_tensor(op, "a", a, (None, None, k), dtypes)
    num_slots, rank = a.shape[:2]
    check_tensor(op, "y", y, (rows, None), dtypes)
    m = y.shape[1]
    check_tensor(op, "b", b, (num_slots, m, rank), dtypes, last_dim_contiguous=False)
    check_index(op, "row_slot", row_slot, (rows,))
    check_tensor(op, "scaling", scaling, (num_slots,), (torch.float32,))
    check_same_dtype(op, x=x, y=y, a=a, b=b)
    if rank > _MAX_RANK:
        raise ValueError(f"{op}: rank {rank} is over the kernel's {_MAX_RANK}")
    if a.stride(2) != 1 or a.stride(1) != k:
        a = a.contiguous()
    if 0 in (rows, m, num_slots, rank):
        return
    t = torch.empty((rows, rank), dtype=torch.float32, device=x.device)  # (N, R) a[s] @ x[i]
    bf16 = x.dtype == torch.bfloat16
    _lora_shrink_kernel[(rows,)](
        x, a, row_slot, t, x.stride(0), a.stride(0), a.stride(1), num_slots,
        K=k, R=rank, BLOCK_R=block(rank), BF16=bf16, enable_fp_fusion=False,
    )  # fmt: skip
    block_m = min(_BLOCK_M, block(m))
    _lora_expand_kernel[(rows, triton.cdiv(m, block_m))](
        t, b, y, row_slot, scaling, y.stride(0), *b.stride(), num_slots,
        M=m, R=rank, BLOCK_M=block_m, BF16=bf16, enable_fp_fusion=False,
    )  # fmt: skip
