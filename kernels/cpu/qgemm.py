"""The quantized GEMM's Python side: its weight layouts and its calls (`qgemm.c`).

The packed layouts put, for each block of 16 output columns, the codes of consecutive
inputs side by side, so that one 64-byte load (int4: 8 inputs; int8: 32 bytes, 2 inputs)
holds exactly one vector of bfloat16 input pairs for the 16 columns once unpacked; both
are a pure permutation of the codes (`pack_int4`, `pack_int8`).

A call splits the output columns, in whole blocks of 16, over up to torch's number of
threads (the rows are never split), and only when it has enough work to pay for the
hand-off (`_SPLIT_MACS`): a decode step's calls of a few microseconds run in the caller.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from radixserve.kernels.cpu.native import native_library
from radixserve.kernels.cpu.threads import run_split

BLOCK = 16  # output columns per block of the packed layouts
_SPLIT_MACS = 1 << 23  # multiply-adds from which a call is split over threads (~30 µs)
_P, _I = ctypes.c_void_p, ctypes.c_int64


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 codes 0..15 → (N/16, K/8, 64) uint8: per block of 16 columns and 8
    inputs, 32 words; word 2c + p holds input 2i + p of column c in nibble i."""
    n, k = q.shape
    v = q.to(torch.int32).view(n // BLOCK, BLOCK, k // 8, 4, 2).permute(0, 2, 1, 4, 3)
    words = (v << torch.tensor([0, 4, 8, 12], dtype=torch.int32)).sum(-1)  # (N/16, K/8, 16, 2)
    return words.to(torch.int16).contiguous().view(torch.uint8).view(n // BLOCK, k // 8, 64)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 → (N/16, K/2, 32) int8: per block of 16 columns and 2 inputs, byte
    2c + p is input p of column c."""
    n, k = q.shape
    return q.view(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3).reshape(n // BLOCK, k // 2, 32)


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """(N, K) bfloat16 → (N/16, K/2, 32) bfloat16: `pack_int8`'s layout in 16-bit words."""
    n, k = w.shape
    return (
        w.reshape(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3).reshape(n // BLOCK, k // 2, 32)
    )


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """The (N, K) int8 codes `pack_int8` packed (a copy)."""
    blocks, pairs = packed.shape[0], packed.shape[1]
    by_column = packed.view(blocks, pairs, BLOCK, 2).permute(0, 2, 1, 3)
    return by_column.reshape(blocks * BLOCK, 2 * pairs)


def unpack_int8_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (T,) of the (N, K) int8 codes `pack_int8` packed: (T, K)."""
    blocks, pairs = packed.shape[0], packed.shape[1]
    by_column = packed.view(blocks, pairs, BLOCK, 2)
    return by_column[ids // BLOCK, :, ids % BLOCK, :].reshape(-1, 2 * pairs)


def native_qgemm() -> QGemm | None:
    """The kernel, or None where the native library is not to be had (`native_library`)."""
    lib = native_library()
    return None if lib is None else _wrap(lib)


@functools.cache
def _wrap(lib: ctypes.CDLL) -> QGemm:
    return QGemm(lib)


class QGemm:
    """The loaded kernel: y = x @ W.T for bfloat16 x (T, K) and a packed weight."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.qgemm_path.restype = ctypes.c_char_p
        lib.qgemm_group_sums.restype = None
        lib.qgemm_group_sums.argtypes = [_P, _I, _I, _I, _I, _P]
        lib.qgemm_int4.restype = None
        lib.qgemm_int4.argtypes = [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I]
        lib.qgemm_int8.restype = None
        lib.qgemm_int8.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I]
        lib.qgemm_bf16.restype = None
        lib.qgemm_bf16.argtypes = [_P, _I, _P, _P, _I, _I, _I, _I, _I, _I]
        self._lib = lib
        self.path: str = lib.qgemm_path().decode()  # "avx512-bf16", "avx2" or "plain"

    def int4(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        group: int,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """x (T, K) bfloat16 @ the int4 weight `pack_int4` packed, with scales and zeros
        (K/group, N, 2) bfloat16: (T, N) in ``out_dtype`` (bfloat16 or float32)."""
        x = _rows(x)
        m, k = x.shape
        n = scales_zeros.shape[1]
        assert packed.shape == (n // BLOCK, k // 8, 64) and scales_zeros.is_contiguous()
        assert group % 16 == 0 and k % group == 0 and scales_zeros.dtype == torch.bfloat16
        y = torch.empty(m, n, dtype=out_dtype)
        if m == 0:
            return y
        xs = torch.empty(m, k // group)  # (T, K/group) each row's group sums
        self._lib.qgemm_group_sums(x.data_ptr(), x.stride(0), m, k, group, xs.data_ptr())
        args = (x.data_ptr(), x.stride(0), packed.data_ptr(), scales_zeros.data_ptr(),
                xs.data_ptr(), y.data_ptr(), n, _f32(out_dtype), m, n, k, group)  # fmt: skip
        run_split(lambda b, e: self._lib.qgemm_int4(*args, b, e), n // BLOCK,
                  m * n * k >= _SPLIT_MACS)  # fmt: skip
        return y

    def int8(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scale: torch.Tensor,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """x (T, K) bfloat16 @ the int8 weight `pack_int8` packed, with its (N,) bfloat16
        scales (N a multiple of 16, K even): (T, N) in ``out_dtype``."""
        x = _rows(x)
        m, k = x.shape
        n = scale.shape[0]
        assert packed.shape == (n // BLOCK, k // 2, 32) and scale.dtype == torch.bfloat16
        y = torch.empty(m, n, dtype=out_dtype)
        if m == 0:
            return y
        args = (x.data_ptr(), x.stride(0), packed.data_ptr(), scale.data_ptr(), y.data_ptr(),
                n, _f32(out_dtype), m, k)  # fmt: skip
        run_split(lambda b, e: self._lib.qgemm_int8(*args, b, e), n // BLOCK,
                  m * n * k >= _SPLIT_MACS)  # fmt: skip
        return y

    def bf16(
        self, x: torch.Tensor, packed: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        """x (T, K) bfloat16 @ the bfloat16 weight `pack_bf16` packed: (T, N) in
        ``out_dtype``."""
        x = _rows(x)
        m, k = x.shape
        n = packed.shape[0] * BLOCK
        assert packed.shape == (n // BLOCK, k // 2, 32) and packed.dtype == torch.bfloat16
        y = torch.empty(m, n, dtype=out_dtype)
        if m == 0:
            return y
        args = (x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), n, _f32(out_dtype),
                m, k)  # fmt: skip
        run_split(lambda b, e: self._lib.qgemm_bf16(*args, b, e), n // BLOCK,
                  m * n * k >= _SPLIT_MACS)  # fmt: skip
        return y


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: bfloat16 rows of unit stride."""
    x = x.to(torch.bfloat16)
    return x if x.stride(-1) == 1 else x.contiguous()


def _f32(dtype: torch.dtype) -> int:
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the quantized GEMM writes bfloat16 or float32, not {dtype}")
    return int(dtype == torch.float32)
