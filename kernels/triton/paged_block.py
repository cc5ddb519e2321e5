"""The step both attention kernels repeat: one block of keys and values, found through the
page table, folded into a running (online) softmax.

Layout: caches (num_pages, page_size, H_kv, D), contiguous within the layer, so key j of
the sequence whose page-table row starts at `table_row` sits at element
((table_row[j // PAGE_SIZE] * PAGE_SIZE + j % PAGE_SIZE) * H_kv + kv_head) * D. Scores
are in the log2 domain (`qk_scale` includes log2(e)); m_i, l_i are each query row's
running maximum and sum of exp2, acc its unnormalised output, all float32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_block(
    q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, offs_n, n_mask,
    visible, offs_d, d_mask, qk_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr, EMPTY_ROWS: tl.constexpr,
):  # fmt: skip
    """Fold keys `offs_n` (BLOCK_N,) into the rows of q (BLOCK_M, BLOCK_D). Only keys in
    `n_mask` are loaded; `visible` (broadcast to BLOCK_M x BLOCK_N) says which query sees
    which of them. Without EMPTY_ROWS every row must see at least one key of its first
    block; with it a row may see none of a block before its first visible key (a sliding
    window's start), at the cost of a guard on the running maximum."""
    page = tl.load(table_row_ptr + offs_n // PAGE_SIZE, mask=n_mask, other=0)
    slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
    kv_off = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
    if DOT_F32:
        k = k.to(tl.float32)
    qk = _dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N)
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_sub = m_new
    if EMPTY_ROWS:  # a row that has seen no key: -inf - -inf would be NaN, subtract 0
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    if DOT_F32:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _dot(a, b):
    # float32 operands multiply in full precision: TF32 (the GPU default) would keep only
    # 10 mantissa bits, far off the float32 reference
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)
