"""Causal attention of a ragged batch of new tokens over their cached prefix pages and
themselves, reading K/V straight from the paged pool (Triton, flash-attention style).

Layout as `radixserve.kernels.reference.extend_attention`: q (T, H, D); cu_seqlens_q
(B + 1,); prefix_lens (B,); page_table (B, W); caches (num_pages, page_size, H_kv, D).
Program (m, b, h) takes BLOCK_M new tokens of sequence b and q head h and walks b's keys
0 .. min(seq_len, prefix + (m + 1) * BLOCK_M) in BLOCK_N steps, finding each key's slot
through the page table (page_table[b, j // page_size] * page_size + j % page_size), with
an online softmax in float32. Nothing past a sequence's length is ever loaded. With a
sliding window w > 0 (query p sees keys p - w < j <= p) the walk starts at the BLOCK_N
boundary at or below the block's first query's window: blocks wholly before it are not
loaded, and keys before a row's window are masked. Window 0 compiles the kernel without
any of that (SLIDING is a compile-time switch).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from radixserve.kernels.triton.checks import block, check_attention, check_index, dot_in_f32
from radixserve.kernels.triton.paged_block import attend_block

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_ptr, prefix_ptr, table_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table, qk_scale, window,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, SLIDING: tl.constexpr,
):  # fmt: skip
    m_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    q_start = tl.load(cu_ptr + b).to(tl.int64)
    q_len = tl.load(cu_ptr + b + 1).to(tl.int64) - q_start
    prefix = tl.load(prefix_ptr + b).to(tl.int64)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )  # fmt: skip
    if DOT_F32:
        q = q.to(tl.float32)
    kv_head = (h // GROUP).to(tl.int64)
    # keys this block of queries can see; a block past the sequence's end sees none
    end = tl.minimum(prefix + q_len, prefix + (m_block + 1) * BLOCK_M)
    end = tl.where(m_block * BLOCK_M < q_len, end, 0).to(tl.int32)  # a 32-bit loop bound
    query_pos = prefix + offs_m
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    table_row = table_ptr + b * stride_table
    # keys before the block's first query position are visible to all its rows: no
    # causal test there; the rest, up to `end`, is masked per row
    full = tl.minimum(prefix + m_block * BLOCK_M, end.to(tl.int64)).to(tl.int32)
    if SLIDING:
        # [lo, mid): from the BLOCK_N boundary below the first row's window start to the
        # last row's (keys from there on are in every row's window), masked per row; a row
        # may see none of a block here, hence EMPTY_ROWS
        lo = tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        mid = tl.minimum(tl.maximum(end - window, lo.to(tl.int32)), full)
        for start in range(lo.to(tl.int32), mid, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < mid
            visible = n_mask[None, :] & (offs_n[None, :] > query_pos[:, None] - window)
            m_i, l_i, acc = attend_block(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head, offs_n, n_mask,
                visible, offs_d, d_mask, qk_scale, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, DOT_F32,
                True,
            )  # fmt: skip
    else:
        mid = 0
    for start in range(mid, full, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < full
        m_i, l_i, acc = attend_block(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head, offs_n, n_mask,
            n_mask[None, :], offs_d, d_mask, qk_scale, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, DOT_F32,
            False,
        )  # fmt: skip
    for start in range(full, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        visible = n_mask[None, :] & (offs_n[None, :] <= query_pos[:, None])
        if SLIDING:
            visible &= offs_n[None, :] > query_pos[:, None] - window
        m_i, l_i, acc = attend_block(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head, offs_n, n_mask,
            visible, offs_d, d_mask, qk_scale, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, DOT_F32,
            SLIDING,
        )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :],
    )  # fmt: skip


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_query_len: int,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """(T, H, D) attention output; `max_query_len` bounds the grid (no device sync)."""
    op = "extend_attention"
    tokens, heads, dim = q.shape
    page_size, kv_heads = check_attention(op, q, k_cache, v_cache)
    check_index(op, "prefix_lens", prefix_lens, (None,))
    batch = prefix_lens.shape[0]
    check_index(op, "cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    check_index(op, "page_table", page_table, (batch, None))
    if window < 0:
        raise ValueError(f"{op}: window {window} is negative (0 means none)")
    out = torch.empty_like(q)  # (T, H, D)
    if tokens == 0 or batch == 0 or max_query_len < 1:
        return out
    # GPU tiles: 128 query rows with 8 warps once there are that many (FlashAttention-2's
    # usual choice for head dim 128), else the fewest rows that cover the longest run
    block_m = 128 if max_query_len >= 128 else block(max_query_len, least=16)
    grid = (triton.cdiv(max_query_len, block_m), batch, heads)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, prefix_lens, page_table,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), page_table.stride(0),
        _LOG2E * (scale if scale is not None else 1 / math.sqrt(dim)), window,
        GROUP=heads // kv_heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=dim, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_D=block(dim, least=16),
        DOT_F32=dot_in_f32(q.dtype), SLIDING=window > 0, num_warps=8 if block_m == 128 else 4,
    )  # fmt: skip
    return out
