"""Gather listed pages of every layer into one contiguous buffer, and back (Triton).

Layout as `radixserve.kernels.reference.pack_pages`: pool (L, 2, P, page_size, H_kv, D),
packed (L, 2, N, page_size, H_kv, D). A page of one layer's K or V is one contiguous run
of page_size * H_kv * D elements; program (region, n, chunk) copies BLOCK of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.triton.checks import (
    block,
    check_index,
    check_same_dtype,
    check_tensor,
    num_warps,
)

_MAX_BLOCK = 4096


@triton.jit
def _copy_pages_kernel(
    pool_ptr, packed_ptr, ids_ptr, num_pool_pages, num_ids,
    PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr, TO_PACKED: tl.constexpr,
):  # fmt: skip
    region = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PAGE_ELEMS
    page = tl.load(ids_ptr + n).to(tl.int64)
    pool_off = (region * num_pool_pages + page) * PAGE_ELEMS + offs
    packed_off = (region * num_ids + n) * PAGE_ELEMS + offs
    if TO_PACKED:
        tl.store(packed_ptr + packed_off, tl.load(pool_ptr + pool_off, mask=mask), mask=mask)
    else:
        tl.store(pool_ptr + pool_off, tl.load(packed_ptr + packed_off, mask=mask), mask=mask)


def _check(op: str, kv: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor) -> None:
    check_tensor(op, "kv", kv, (None, 2, None, None, None, None))
    if not kv.is_contiguous():
        raise ValueError(f"{op}: kv must be the contiguous pool tensor")
    check_index(op, "page_ids", page_ids, (None,))
    layers, _, _, page_size, heads, dim = kv.shape
    check_tensor(op, "packed", packed, (layers, 2, page_ids.shape[0], page_size, heads, dim))
    if not packed.is_contiguous():
        raise ValueError(f"{op}: packed must be contiguous")
    check_same_dtype(op, kv=kv, packed=packed)


def _launch(kv: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor, to_packed: bool):
    page_elems = kv[0, 0, 0].numel()
    bs = block(min(page_elems, _MAX_BLOCK))
    grid = (kv.shape[0] * 2, page_ids.shape[0], triton.cdiv(page_elems, bs))
    _copy_pages_kernel[grid](
        kv, packed, page_ids, kv.shape[2], page_ids.shape[0],
        PAGE_ELEMS=page_elems, BLOCK=bs, TO_PACKED=to_packed, num_warps=num_warps(bs),
    )  # fmt: skip


def pack_pages(
    kv: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The pages `page_ids` of `kv`, (L, 2, N, page_size, H_kv, D), written into `out` if given."""
    if out is None:
        shape = list(kv.shape)
        shape[2] = page_ids.shape[0] if page_ids.dim() == 1 else 0
        out = torch.empty(shape, dtype=kv.dtype, device=kv.device)
    _check("pack_pages", kv, page_ids, out)
    if page_ids.shape[0]:
        _launch(kv, page_ids, out, to_packed=True)
    return out


def unpack_pages(kv: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Write `packed` (L, 2, N, page_size, H_kv, D) into pool pages `page_ids` of `kv`."""
    _check("unpack_pages", kv, page_ids, packed)
    if page_ids.shape[0]:
        _launch(kv, page_ids, packed, to_packed=False)
