"""Extend and decode attention on CPU through one batch-invariant kernel (`attention.c`).

Both ops have the reference signatures (`reference/extend_attention.py`,
`reference/decode_attention.py`) and hand the kernel the same thing: query rows, each
with its sequence and position. A row is attended by one fixed sequence of operations
over blocks of 16 key positions counted from position 0, whatever the other rows of the
call, whether its sequence's earlier tokens were computed in this step or cached, and
whether it is an extend row or a decode row: so a cached-prefix extend, a full prefill,
a chunked prefill and the decode steps that produced a prefix all give a token the same
bits, and a prompt's KV computed by one worker equals another's.

The kernel reads K and V in place through the page table (no gather). It takes float32
and bfloat16 pools, head sizes that are multiples of 16 up to 256, any page size and
GQA ratio, and sliding windows. Anything else, a device other than the CPU, or no native
library, goes to the previous paths: the reference extend and `cpu/decode_attention.py`
(not batch-invariant).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from radixserve.kernels.cpu.decode_attention import decode_attention as gathered_decode
from radixserve.kernels.cpu.native import native_library
from radixserve.kernels.cpu.threads import run_strided
from radixserve.kernels.reference.extend_attention import extend_attention as reference_extend

ROWS_PER_ITEM = 64  # rows of one sequence that share each block of K/V read in a work item
_SPLIT_WORK = 1 << 16  # key-head-dims / 16 from which a call is split over threads (~30 µs)
_MAX_DIM = 256
_P, _I = ctypes.c_void_p, ctypes.c_int64


class PagedAttention:
    """The loaded kernel: out (T, H, D) for query rows given by (sequence, position)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.attention_path.restype = ctypes.c_char_p
        lib.paged_attention.restype = None
        lib.paged_attention.argtypes = [_P, _I, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I,
                                        _I, _I, ctypes.c_double, _I, _P, _I, _I, _I, _I]  # fmt: skip
        lib.attention_item_heads.restype = _I
        lib.attention_item_heads.argtypes = [_I, _I, _I]
        self._lib = lib
        self.path: str = lib.attention_path().decode()  # "avx512", "avx2" or "plain"
        # kv heads per work item: None lets the library choose (all of them where the
        # chunks keep every thread busy); the tests pin 1 or all to compare the bits
        self.item_heads: int | None = None

    def __call__(
        self,
        q: torch.Tensor,  # (T, H, D), unit stride in D
        k_cache: torch.Tensor,  # (P, page_size, H_kv, D) contiguous
        v_cache: torch.Tensor,
        page_table: torch.Tensor,  # (B, W) int64
        row_seq: torch.Tensor,  # (T,) int64 each row's sequence (row of page_table)
        row_pos: torch.Tensor,  # (T,) int64 each row's position; -1: padding (output 0)
        chunks: list[int],  # row boundaries: rows [chunks[i], chunks[i+1]) share a sequence
        window: int,
        scale: float,
    ) -> torch.Tensor:
        t, heads, dim = q.shape
        kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
        out = torch.empty(t, heads, dim, dtype=q.dtype)
        if t == 0:
            return out
        bounds = torch.tensor(chunks, dtype=torch.int64)
        table = page_table.contiguous()
        args = (q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                out.data_ptr(), row_seq.data_ptr(), row_pos.data_ptr(), table.data_ptr(),
                table.stride(0), page_size, heads, kv_heads, dim, window, scale,
                int(q.dtype == torch.bfloat16), bounds.data_ptr())  # fmt: skip
        work = int(row_pos.clamp(min=0).sum()) * heads * dim // 16
        split = work >= _SPLIT_WORK
        threads = torch.get_num_threads() if split else 1
        item_heads = self.item_heads if self.item_heads is not None else (
            self._lib.attention_item_heads(len(chunks) - 1, kv_heads, threads))  # fmt: skip
        # item_heads -n: each chunk's q heads in n contiguous parts (attention.c)
        items = (len(chunks) - 1) * (kv_heads // item_heads if item_heads > 0 else -item_heads)
        run_strided(lambda first, step: self._lib.paged_attention(*args, item_heads, first,
                                                                  items, step),
                    items, split)  # fmt: skip
        return out


def native_attention() -> PagedAttention | None:
    """The kernel, or None where the native library is not to be had."""
    lib = native_library()
    return None if lib is None else _wrap(lib)


@functools.cache
def _wrap(lib: ctypes.CDLL) -> PagedAttention:
    return PagedAttention(lib)


def _kernel_for(q: torch.Tensor, k_cache: torch.Tensor) -> PagedAttention | None:
    """The kernel where it takes these tensors, else None."""
    dim = q.shape[-1]
    if (
        q.device.type != "cpu"
        or q.dtype not in (torch.float32, torch.bfloat16)
        or k_cache.dtype != q.dtype
        or dim % 16
        or dim > _MAX_DIM
        or q.stride(-1) != 1
        or not k_cache.is_contiguous()
    ):
        return None
    return native_attention()


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
    """As `reference.extend_attention`: (T, H, D)."""
    kernel = _kernel_for(q, k_cache)
    if kernel is None or not v_cache.is_contiguous():
        return reference_extend(q, k_cache, v_cache, cu_seqlens_q, prefix_lens, page_table,
                                max_query_len, window, scale)  # fmt: skip
    starts = cu_seqlens_q.tolist()
    counts = torch.tensor([e - s for s, e in zip(starts, starts[1:])], dtype=torch.int64)
    row_seq = torch.repeat_interleave(torch.arange(len(counts)), counts)  # (T,)
    first = torch.tensor(starts[:-1], dtype=torch.int64)
    row_pos = prefix_lens.to(torch.int64)[row_seq] + torch.arange(q.shape[0]) - first[row_seq]
    chunks = [r for s, e in zip(starts, starts[1:]) for r in range(s, e, ROWS_PER_ITEM)]
    return kernel(q, k_cache, v_cache, page_table, row_seq, row_pos, [*chunks, starts[-1]],
                  window, _scale(q, scale))  # fmt: skip


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
    """As `reference.decode_attention`: (B, H, D); a row of seq_len 0 is padding (0)."""
    kernel = _kernel_for(q, k_cache)
    if kernel is None or not v_cache.is_contiguous():
        return gathered_decode(q, k_cache, v_cache, page_table, seq_lens, num_splits,
                               window, scale)  # fmt: skip
    batch = q.shape[0]
    row_pos = seq_lens.to(torch.int64) - 1  # the new token's position; -1 for padding
    return kernel(q, k_cache, v_cache, page_table, torch.arange(batch), row_pos,
                  list(range(batch + 1)), window, _scale(q, scale))  # fmt: skip


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else q.shape[-1] ** -0.5
