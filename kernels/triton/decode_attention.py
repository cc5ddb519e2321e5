"""Split-K (flash-decoding) attention of one new token per sequence over its pages (Triton).

Layout as `radixserve.kernels.reference.decode_attention`: q (B, H, D); page_table (B, W);
seq_lens (B,), 0 for a padding row (output 0); caches (num_pages, page_size, H_kv, D).

Stage 1, program (b, kv_head, split): the q heads sharing that kv head (a GQA group,
padded to 16 rows for tl.dot) attend to the split's share of the n tokens b's query sees,
ceil(n / num_splits) of them, each found through the page table (n = seq_len; with a
sliding window w, the last min(w, seq_len): the splits divide the window alone and no key
before it is loaded); it writes the partial output and its log-sum-exp (log2 domain) to
float32 scratch. Stage 2, program (b, head): merges the splits, weighting each by
exp2(lse - max lse). Splitting lets one long context use the whole GPU; the grid depends
only on B and num_splits, never on lengths, so it can be captured in a CUDA graph;
num_splits and the window are run-time arguments, so changing them does not compile a
new kernel (the merge's block is num_splits' next power of two).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from radixserve.kernels.triton.checks import block, check_attention, check_index, dot_in_f32
from radixserve.kernels.triton.paged_block import attend_block

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, lens_ptr, mid_o_ptr, mid_lse_ptr,
    stride_qb, stride_qh, stride_table, qk_scale, num_splits, window,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # first key it sees
    split_len = tl.cdiv(seq_len - first, num_splits)
    start = (first + split * split_len).to(tl.int32)  # 32-bit loop bounds
    end = tl.minimum(first + split * split_len + split_len, seq_len).to(tl.int32)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h  # (BLOCK_H,) q heads of this kv head
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :], other=0.0,
    )  # fmt: skip
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    table_row = table_ptr + b * stride_table
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        m_i, l_i, acc = attend_block(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head, offs_n, n_mask,
            n_mask[None, :], offs_d, d_mask, qk_scale, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, DOT_F32,
            False,
        )  # fmt: skip
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    row = (b * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split  # (BLOCK_H,)
    tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=h_mask[:, None] & d_mask[None, :])  # fmt: skip
    tl.store(mid_lse_ptr + row, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    row = (b * NUM_HEADS + h) * num_splits
    lse = tl.load(mid_lse_ptr + row + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no keys at all: every weight is 0
    w = tl.exp2(lse - top)  # (BLOCK_S,)
    o = tl.load(mid_o_ptr + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
    total = tl.sum(w, axis=0)
    merged = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d,
             merged.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)  # fmt: skip


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_units: int) -> int:
    """Splits per sequence so that about four programs run per compute unit, none of them
    on fewer than 256 tokens, at most MAX_SPLITS."""
    by_work = triton.cdiv(4 * num_units, max(1, batch * num_kv_heads))
    by_length = triton.cdiv(max(1, max_seq_len), 256)
    return max(1, min(MAX_SPLITS, by_work, by_length))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int | None = None,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """(B, H, D) attention of each sequence's one query over tokens 0..seq_lens[b] - 1, or
    its last `window` of them."""
    op = "decode_attention"
    page_size, kv_heads = check_attention(op, q, k_cache, v_cache)
    batch, heads, dim = q.shape
    check_index(op, "page_table", page_table, (batch, None))
    check_index(op, "seq_lens", seq_lens, (batch,))
    splits = num_splits if num_splits is not None else 8
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"{op}: num_splits {splits} is outside [1, {MAX_SPLITS}]")
    if window < 0:
        raise ValueError(f"{op}: window {window} is negative (0 means none)")
    out = torch.empty_like(q)  # (B, H, D)
    if batch == 0:
        return out
    group = heads // kv_heads
    mid_o = torch.empty((batch, heads, splits, dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    block_d = block(dim, least=16)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, page_table, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), page_table.stride(0),
        _LOG2E * (scale if scale is not None else 1 / math.sqrt(dim)), splits, window,
        GROUP=group, NUM_KV_HEADS=kv_heads, HEAD_DIM=dim, PAGE_SIZE=page_size,
        BLOCK_H=block(group, least=16), BLOCK_N=64, BLOCK_D=block_d,
        DOT_F32=dot_in_f32(q.dtype),
    )  # fmt: skip
    _decode_merge_kernel[(batch, heads)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), splits,
        NUM_HEADS=heads, HEAD_DIM=dim, BLOCK_S=block(splits), BLOCK_D=block_d,
    )  # fmt: skip
    return out
