"""The batched LoRA matmul on CPU through the native kernel (`lora.c`), with the
reference's signature and bits (`reference/lora.py` writes the kernel's order of
additions with torch ops, so the two are equal, not merely close).

Two calls: the shrink (each row's t = a[s] @ x[i], split over rows) and the expand (each
row's y[i] += scaling[s] * b[s] @ t, split over output columns). Every row is computed
whole by a fixed sequence of operations, so neither split nor the other rows of the
batch change its bits. A device other than the CPU, a y whose columns are not adjacent,
or no native library goes to the reference.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from radixserve.kernels.cpu.native import native_library
from radixserve.kernels.cpu.threads import run_split
from radixserve.kernels.reference.lora import check_lora_args
from radixserve.kernels.reference.lora import lora_apply as reference_lora_apply

# multiply-adds from which a pass is split over threads: ~150 µs of one thread (the fixed
# order of the sums costs about three vector ops per multiply-add), the hand-off ~30 µs
_SPLIT_MACS = 1 << 20
_LANES = 16  # partial sums per dot product (lora.c's LANES): t's rows are padded to them
_COLUMNS = 16  # columns of y per block of the expand (lora.c's COLUMNS)
_P, _I = ctypes.c_void_p, ctypes.c_int64


class NativeLora:
    """The loaded kernel."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.lora_shrink.restype = None
        lib.lora_shrink.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I]
        lib.lora_expand.restype = None
        lib.lora_expand.argtypes = [_P, _P, _I, _I, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I]
        self._lib = lib

    def __call__(
        self,
        x: torch.Tensor,  # (N, K), unit stride in K
        y: torch.Tensor,  # (N, M), unit stride in M
        a: torch.Tensor,  # (L, R, K) contiguous
        b: torch.Tensor,  # (L, M, R), unit stride in M or in R
        row_slot: torch.Tensor,  # (N,) int64 contiguous, each in [-1, L)
        scaling: torch.Tensor,  # (L,) float32 contiguous
    ) -> None:
        (n, k), m, rank = x.shape, y.shape[1], a.shape[1]
        bf16 = int(x.dtype == torch.bfloat16)
        # (N, R rounded up to 16) float32: each row's a[s] @ x[i], rounded to x's dtype
        t = torch.empty(n, -(-rank // _LANES) * _LANES)
        shrink = (x.data_ptr(), x.stride(0), a.data_ptr(), row_slot.data_ptr(), t.data_ptr(),
                  k, rank, bf16)  # fmt: skip
        run_split(lambda lo, hi: self._lib.lora_shrink(*shrink, lo, hi), n,
                  n * rank * k >= _SPLIT_MACS)  # fmt: skip
        expand = (t.data_ptr(), b.data_ptr(), *b.stride(), scaling.data_ptr(),
                  row_slot.data_ptr(), y.data_ptr(), y.stride(0), n, rank, a.shape[0], bf16)  # fmt: skip
        run_split(lambda lo, hi: self._lib.lora_expand(*expand, lo * _COLUMNS,
                                                       min(hi * _COLUMNS, m)),
                  -(-m // _COLUMNS), n * rank * m >= _SPLIT_MACS)  # fmt: skip


def native_lora() -> NativeLora | None:
    """The kernel, or None where the native library is not to be had."""
    lib = native_library()
    return None if lib is None else _wrap(lib)


@functools.cache
def _wrap(lib: ctypes.CDLL) -> NativeLora:
    return NativeLora(lib)


def lora_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slot: torch.Tensor,
    scaling: torch.Tensor,
) -> None:
    """As `reference.lora.lora_apply`: in place on y (N, M). B is read in place in either
    layout: (L, M, R) contiguous, or stored (L, R, M) and passed as its
    ``.transpose(1, 2)`` (faster here: the kernel's vectors run along M)."""
    kernel = native_lora() if x.device.type == "cpu" else None
    if kernel is None or y.stride(1) != 1:
        reference_lora_apply(x, y, a, b, row_slot, scaling)
        return
    check_lora_args(x, y, a, b, row_slot, scaling)
    if 0 in (x.shape[0], y.shape[1], a.shape[0], a.shape[1]):
        return
    if b.stride(1) != 1 and b.stride(2) != 1:
        b = b.contiguous()
    kernel(x if x.stride(1) == 1 else x.contiguous(), y, a.contiguous(), b,
           row_slot.contiguous(), scaling.contiguous())  # fmt: skip
