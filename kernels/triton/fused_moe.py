"""The mixture-of-experts MLP (Triton): a grouped GEMM over sorted token blocks.

Layout and result as `radixserve.kernels.reference.fused_moe`. The (token, slot) pairs
are sorted by expert and each expert's run padded to a multiple of BLOCK_M
(`_align`: pair ids, padding = T K, and each block's expert), so every block of BLOCK_M
sorted pairs belongs to one expert. Two launches of one kernel, one program per
(block, BLOCK_N columns):

1. gate/up: rows gather x[pair // K], times w_gate_up[expert]^T → (T K, 2 I); then the
   activation silu(gate) * up (`silu_and_mul`) → (T K, I);
2. down: rows of that, times w_down[expert]^T, each scaled by its pair's weight →
   (T K, H), summed over each token's K pairs.

Blocks past the last real one (the padding's upper bound) do nothing; padded rows are
masked. Accumulation in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.triton.checks import check_tensor
from radixserve.kernels.triton.silu_and_mul import silu_and_mul

_INDEX = (torch.int64,)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, pair_ptr, expert_ptr, weight_ptr, num_pairs,
    stride_a, stride_be, stride_bn, stride_c,
    N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, GATHER: tl.constexpr,
    WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pairs = tl.load(pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    valid = pairs < num_pairs
    expert = tl.load(expert_ptr + block).to(tl.int64)
    rows = tl.where(GATHER, pairs // TOP_K, pairs).to(tl.int64)  # A's row of each pair
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :],
                    mask=valid[:, None] & (ks[None, :] < K), other=0.0)  # fmt: skip
        b = tl.load(b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)  # fmt: skip
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
    if WEIGHTED:
        w = tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    out = c_ptr + pairs.to(tl.int64)[:, None] * stride_c + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def _align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids sorted by expert, each expert's run padded to block_m with T K; each
    block's expert)."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    sorted_ids = torch.full((int(ends[-1]),), flat.numel(), dtype=torch.int64, device=flat.device)
    rank = (
        torch.arange(flat.numel(), device=flat.device)
        - (torch.cumsum(counts, 0) - counts)[flat[order]]
    )
    sorted_ids[starts[flat[order]] + rank] = order
    experts = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // block_m
    )
    return sorted_ids, experts


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    block_m: int = 16,
    block_n: int = 32,
    block_k: int = 32,
) -> torch.Tensor:
    op = "fused_moe"
    check_tensor(op, "x", x, (None, None))
    tokens, hidden = x.shape
    check_tensor(op, "w_gate_up", w_gate_up, (None, None, hidden))
    experts, two_inter = w_gate_up.shape[0], w_gate_up.shape[1]
    inter = two_inter // 2
    check_tensor(op, "w_down", w_down, (experts, hidden, inter))
    check_tensor(op, "topk_ids", topk_ids, (tokens, None), _INDEX)
    top_k = topk_ids.shape[1]
    check_tensor(op, "topk_weights", topk_weights, (tokens, top_k))
    if not tokens:
        return x.new_zeros((0, hidden))
    sorted_ids, block_experts = _align(topk_ids, experts, block_m)
    weights = topk_weights.flatten().contiguous()
    blocks = (sorted_ids, block_experts, weights, top_k, (block_m, block_n, block_k))
    gate_up = _gemm(x, w_gate_up, x.dtype, blocks, gather=True)  # (T K, 2 I)
    down = _gemm(silu_and_mul(gate_up), w_down, torch.float32, blocks, gather=False)
    return down.view(tokens, top_k, hidden).sum(1).to(x.dtype)


def _gemm(
    a: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, blocks: tuple, gather: bool
) -> torch.Tensor:
    """(T K, N): each sorted pair's row of ``a`` (its token's, with ``gather``) times its
    expert's ``w`` (E, N, K)^T; the second GEMM (not ``gather``) scales by the weights."""
    sorted_ids, block_experts, weights, top_k, (block_m, block_n, block_k) = blocks
    pairs, n = weights.numel(), w.shape[1]
    c = torch.empty((pairs, n), dtype=dtype, device=a.device)
    _moe_gemm_kernel[(block_experts.numel(), triton.cdiv(n, block_n))](
        a, w, c, sorted_ids, block_experts, weights, pairs,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        N=n, K=w.shape[2], TOP_K=top_k, GATHER=gather, WEIGHTED=not gather,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return c
