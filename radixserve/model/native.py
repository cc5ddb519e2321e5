"""A small C routine that unpacks int4 weights for prefill, built on first use.

`Int4Linear` runs prefill chunks as dequantize + dense matmul; done with torch ops the
dequantization costs about six times the matmul it feeds (several passes over the
weight, bfloat16 elementwise ops). This routine does it in one pass, in parallel over K,
straight from the CPU kernel's packed layout into the (K, N) matrix the matmul reads.

It is compiled with the system C compiler (``cc``, or ``$CC``) into the user's cache
(``$XDG_CACHE_HOME/radixserve``, else ``~/.cache/radixserve``), once per source and CPU
(``-march=native``: the file name carries a hash of both), written atomically so that
workers starting together do not race. Without a compiler, or if the build fails, the
torch-ops path is used (slower prefill, same results up to rounding) and this is logged
once. ``RADIXSERVE_NATIVE_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t float_to_bf16(float f) {  /* round to nearest even */
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* packed: (n/64, k, 32) bytes, low nibble row j, high nibble row j + 32 of each block;
   sz: (k/group, n, 2) bfloat16 (scale, zero); w = (q - 8) * scale + zero.
   out: (k, n), bfloat16 when bf16_out, else float32. */
void dequant_int4(const uint8_t *packed, const uint16_t *sz, void *out, int64_t n,
                  int64_t k, int64_t group, int bf16_out, int threads) {
    int64_t blocks = n / 64;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t kk = 0; kk < k; kk++) {
        const uint16_t *g = sz + (kk / group) * n * 2;
        for (int64_t nb = 0; nb < blocks; nb++) {
            const uint8_t *p = packed + (nb * k + kk) * 32;
            int64_t n0 = nb * 64;
            float lo[32], hi[32];
            for (int j = 0; j < 32; j++) {
                lo[j] = (float)((p[j] & 15) - 8) * bf16_to_float(g[(n0 + j) * 2])
                        + bf16_to_float(g[(n0 + j) * 2 + 1]);
                hi[j] = (float)((p[j] >> 4) - 8) * bf16_to_float(g[(n0 + 32 + j) * 2])
                        + bf16_to_float(g[(n0 + 32 + j) * 2 + 1]);
            }
            if (bf16_out) {
                uint16_t *row = (uint16_t *)out + kk * n + n0;
                for (int j = 0; j < 32; j++) { row[j] = float_to_bf16(lo[j]); }
                for (int j = 0; j < 32; j++) { row[32 + j] = float_to_bf16(hi[j]); }
            } else {
                float *row = (float *)out + kk * n + n0;
                memcpy(row, lo, sizeof lo);
                memcpy(row + 32, hi, sizeof hi);
            }
        }
    }
}
"""
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

Dequant = Callable[[torch.Tensor, torch.Tensor, int, int, int, torch.dtype], torch.Tensor]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "radixserve"


def _build() -> Path | None:
    """The compiled library's path (building it if needed), or None when it cannot be."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.info("no C compiler: int4 prefill dequantizes with torch ops (slower)")
        return None
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + _cpu_flags()).encode()).hexdigest()
    target = _cache_dir() / f"dequant-{digest[:16]}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, lib = Path(tmp) / "dequant.c", Path(tmp) / "dequant.so"
            src.write_text(_SOURCE)
            subprocess.run([cc, *_FLAGS, str(src), "-o", str(lib)], check=True,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
            os.replace(lib, target)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.info("building the int4 dequantizer failed (%s): torch ops instead", detail)
        return None
    return target


@functools.lru_cache(maxsize=1)
def native_dequant() -> Dequant | None:
    """The C int4 dequantizer as a function, or None (see the module docstring)."""
    if os.environ.get("RADIXSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    path = _build()
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(str(path)).dequant_int4
    except OSError as exc:
        logger.info("loading %s failed (%s): torch ops instead", path, exc)
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]  # fmt: skip

    def dequant(
        packed: torch.Tensor, sz: torch.Tensor, n: int, k: int, group: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """(K, N) weight in `dtype` (bfloat16 or float32) from the packed int4 layout."""
        assert packed.is_contiguous() and sz.is_contiguous() and sz.dtype == torch.bfloat16
        out = torch.empty(k, n, dtype=dtype)
        fn(packed.data_ptr(), sz.data_ptr(), out.data_ptr(), n, k, group,
           int(dtype == torch.bfloat16), torch.get_num_threads())  # fmt: skip
        return out

    return dequant
