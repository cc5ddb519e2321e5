"""A small C routine that unpacks int4 weights for prefill, built on first use.

`Int4Linear` runs prefill chunks as dequantize + dense matmul; done with torch ops the
dequantization costs about six times the matmul it feeds (several passes over the
weight, bfloat16 elementwise ops). This routine does it in one pass, in parallel over K,
straight from the CPU kernel's packed layout into the (K, N) matrix the matmul reads
(AVX-512 with bfloat16 conversions where the CPU has them, plain C otherwise);
ranges of K run on a small thread pool (ctypes releases the GIL), as many as torch's
threads. It links no OpenMP runtime of its own: a second one beside torch's in the same
process is asking for trouble.

It writes the weight as two bfloat16 matrices, hi = bf16(w) and lo = bf16(w - hi): one
dense matmul of [x, x] against [hi; lo] then multiplies x by w to within 2^-16 and
accumulates in float32 like the kernel, so the two paths agree as closely as two dense
matmuls of different shapes do (a token computed in a prefill chunk and the same token
computed alone in a cached turn's short delta get the same logits, to float32 rounding).

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
from concurrent.futures import ThreadPoolExecutor
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
   sz: (k/group, n, 2) bfloat16 (scale, zero); w = (q - 8) * scale + zero, in float32.
   out: (2k, n) bfloat16: rows [0, k) hold hi = bf16(w), rows [k, 2k) lo = bf16(w - hi),
   so that hi + lo is w to within 2^-16 of it. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
/* 16 rows of one k: codes (low or high nibbles of 16 bytes) -> hi and lo bfloat16 */
static inline void rows16(const uint8_t *p, int high, const uint16_t *g, uint16_t *hi,
                          uint16_t *lo) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    q = high ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, _mm512_set1_epi32(15));
    __m512 qf = _mm512_sub_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(8.0f));
    __m512i sz = _mm512_loadu_si512((const void *)g);  /* 16 (scale, zero) pairs */
    __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
    __m512 z = _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32((int)0xFFFF0000)));
    __m512 w = _mm512_fmadd_ps(qf, s, z);
    __m256bh h = _mm512_cvtneps_pbh(w);
    __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
    _mm256_storeu_si256((__m256i *)hi, (__m256i)h);
    _mm256_storeu_si256((__m256i *)lo, (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(w, hf)));
}
#endif

void dequant_int4(const uint8_t *packed, const uint16_t *sz, uint16_t *out, int64_t n,
                  int64_t k, int64_t group, int64_t k_begin, int64_t k_end) {
    int64_t blocks = n / 64;
    for (int64_t kk = k_begin; kk < k_end; kk++) {  /* rows [k_begin, k_end) of K */
        const uint16_t *g = sz + (kk / group) * n * 2;
        uint16_t *hi_row = out + kk * n, *lo_row = out + (k + kk) * n;
        for (int64_t nb = 0; nb < blocks; nb++) {
            const uint8_t *p = packed + (nb * k + kk) * 32;
            int64_t n0 = nb * 64;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            for (int r = 0; r < 64; r += 16) {  /* rows n0 + r .. n0 + r + 15 */
                rows16(p + (r & 31), r >= 32, g + (n0 + r) * 2, hi_row + n0 + r, lo_row + n0 + r);
            }
            continue;
#endif
            float w[64];
            for (int j = 0; j < 32; j++) {
                w[j] = (float)((p[j] & 15) - 8) * bf16_to_float(g[(n0 + j) * 2])
                       + bf16_to_float(g[(n0 + j) * 2 + 1]);
                w[32 + j] = (float)((p[j] >> 4) - 8) * bf16_to_float(g[(n0 + 32 + j) * 2])
                            + bf16_to_float(g[(n0 + 32 + j) * 2 + 1]);
            }
            for (int j = 0; j < 64; j++) {
                uint16_t h = float_to_bf16(w[j]);
                hi_row[n0 + j] = h;
                lo_row[n0 + j] = float_to_bf16(w[j] - bf16_to_float(h));
            }
        }
    }
}
"""
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")

Dequant = Callable[[torch.Tensor, torch.Tensor, int, int, int], torch.Tensor]


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
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # fmt: skip

    def dequant(packed: torch.Tensor, sz: torch.Tensor, n: int, k: int, group: int) -> torch.Tensor:
        """The (2K, N) bfloat16 hi/lo pair of the weight (see the C source)."""
        assert packed.is_contiguous() and sz.is_contiguous() and sz.dtype == torch.bfloat16
        out = torch.empty(2 * k, n, dtype=torch.bfloat16)
        args = (packed.data_ptr(), sz.data_ptr(), out.data_ptr(), n, k, group)
        parts = min(torch.get_num_threads(), max(1, k // 64))
        bounds = [k * i // parts for i in range(parts + 1)]
        if parts == 1:
            fn(*args, 0, k)
        else:
            list(_pool().map(lambda i: fn(*args, bounds[i], bounds[i + 1]), range(parts)))
        return out

    return dequant


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()),
                              thread_name_prefix="dequant")  # fmt: skip
