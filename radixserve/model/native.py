"""A small C routine that unpacks int4 weights for prefill: prebuilt, or built on first use.

`Int4Linear` runs prefill chunks as dequantize + dense matmul; done with torch ops the
dequantization costs about six times the matmul it feeds (several passes over the
weight, bfloat16 elementwise ops). This routine does it in one pass, in parallel over K,
straight from the CPU kernel's packed layout into the (K, N) matrix the matmul reads
(AVX-512 with bfloat16 conversions where the CPU has them, plain C otherwise);
ranges of K run on a small thread pool (ctypes releases the GIL), as many as torch's
threads. It links no OpenMP runtime of its own: a second one beside torch's in the same
process is asking for trouble.

It writes the weight as the bfloat16 pair hi = bf16(w), lo = bf16(w - hi) that the
dense path multiplies by (why a pair: `_KernelLinear.dense_pair`, `radixserve.model.qlinear`).

Where the routine comes from, first found wins (logged once, at INFO):

1. ``$RADIXSERVE_NATIVE_DIR``: a directory of prebuilt variants, written by
   ``python -m radixserve.model.native DIR`` where a compiler is (an image's build
   stage: its runtime stage has none). The best variant whose CPU flags
   ``/proc/cpuinfo`` lists is loaded: on x86-64, AVX-512 with bfloat16 (x86-64-v4 +
   avx512bf16), AVX2 (x86-64-v3) or the x86-64 baseline; elsewhere one baseline. They
   are built with portable flags only, never ``-march=native`` (an image runs on other
   CPUs than the one that built it), and named by variant and a hash of the source and
   flags, so a file built from another version of the source is never loaded.
2. Built on first use with the system C compiler (``cc``, or ``$CC``) into the user's
   cache (``$XDG_CACHE_HOME/radixserve``, else ``~/.cache/radixserve``), once per source
   and CPU (``-march=native``: the file name carries a hash of both), written atomically
   so that workers starting together do not race.
3. Torch ops (`Int4Linear`'s own dequantization): slower prefill.

All of them give the same hi/lo pair bit for bit (the product (q - 8) * scale is exact
in float32, so only the add rounds, fused or not; every conversion to bfloat16 rounds to
nearest even, and AVX-512's, which flushes subnormals, has them redone in plain C), and
`Int4Linear` takes the same path with or without the routine, so which one runs changes
prefill speed, never a token (tests/model/test_native.py, tests/engine/test_native_fallback.py).
``RADIXSERVE_NATIVE_KERNELS=0`` turns the routine off (torch ops).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.model.quant import int4_pack_block

logger = logging.getLogger(__name__)

# the routine itself, shipped beside this module (package data)
_SOURCE = (Path(__file__).parent / "dequant_int4.c").read_text()
_COMMON_FLAGS = ("-O3", "-shared", "-fPIC")
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")  # built on first use, for this CPU

Dequant = Callable[[torch.Tensor, torch.Tensor, int, int, int], torch.Tensor]


@dataclass(frozen=True)
class Variant:
    """A portable build of the routine: its compiler flags and the CPU flags (as
    /proc/cpuinfo names them) that the code those flags allow needs."""

    name: str
    flags: tuple[str, ...]
    cpu_flags: frozenset[str] = frozenset()

    @property
    def file_name(self) -> str:
        return f"dequant-{self.name}-{_digest(self.flags)}.so"


# the x86-64 micro-architecture levels' features, as /proc/cpuinfo names them
_X86_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_X86_V3 = _X86_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_X86_VARIANTS = (  # best first; one thread, a 1536 x 576 weight (Zen 4): 0.20, 0.35, 0.71 ms
    Variant(
        "x86-64-v4-bf16",
        (*_COMMON_FLAGS, "-march=x86-64-v4", "-mavx512bf16"),
        _X86_V4 | {"avx512_bf16"},
    ),
    Variant("x86-64-v3", (*_COMMON_FLAGS, "-march=x86-64-v3"), _X86_V3),
    Variant("x86-64", (*_COMMON_FLAGS, "-march=x86-64", "-mtune=generic")),
)


def variants(machine: str | None = None) -> tuple[Variant, ...]:
    """The prebuilt variants for an architecture (this one by default), best first."""
    machine = machine or platform.machine()
    if machine.lower() in ("x86_64", "amd64"):
        return _X86_VARIANTS
    return (Variant("baseline", _COMMON_FLAGS),)


def _digest(flags: Sequence[str], extra: str = "") -> str:
    return hashlib.sha256((_SOURCE + " ".join(flags) + extra).encode()).hexdigest()[:16]


def cpu_flags() -> str:
    """The kernel's "flags" line of /proc/cpuinfo ("" where it cannot be read)."""
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


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compile(cc: str, flags: Sequence[str], target: Path) -> None:
    """Compile the source into ``target``, atomically (raises on failure)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, lib = Path(tmp) / "dequant.c", Path(tmp) / "dequant.so"
        src.write_text(_SOURCE)
        subprocess.run([cc, *flags, str(src), "-o", str(lib)], check=True,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
        os.replace(lib, target)


def build_variants(folder: Path, cc: str | None = None) -> list[Path]:
    """Compile every variant of this architecture into ``folder`` (those already there
    are kept: the name says what they were built from); raises if one fails."""
    cc = cc or _compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC)")
    built = []
    for variant in variants():
        target = folder / variant.file_name
        if not target.exists():
            _compile(cc, variant.flags, target)
        built.append(target)
    return built


def _load(path: Path) -> ctypes._NamedFuncPointer | None:
    try:
        return ctypes.CDLL(str(path)).dequant_int4
    except OSError as exc:
        logger.info("loading %s failed (%s)", path, exc)
        return None


def _prebuilt() -> ctypes._NamedFuncPointer | None:
    """The best prebuilt variant in $RADIXSERVE_NATIVE_DIR this CPU runs, if any."""
    folder = os.environ.get("RADIXSERVE_NATIVE_DIR")
    if not folder:
        return None
    have = set(cpu_flags().partition(":")[2].split())
    for variant in variants():
        path = Path(folder) / variant.file_name
        if variant.cpu_flags <= have and path.exists() and (fn := _load(path)) is not None:
            logger.info("int4 dequantizer: prebuilt, %s (%s)", variant.name, path)
            return fn
    logger.warning("RADIXSERVE_NATIVE_DIR=%s holds no int4 dequantizer built from this "
                   "source that this CPU runs (python -m radixserve.model.native DIR)",
                   folder)  # fmt: skip
    return None


def _built() -> ctypes._NamedFuncPointer | None:
    """The routine built for this CPU in the user's cache (building it if needed)."""
    cc = _compiler()
    if cc is None:
        logger.debug("no C compiler to build the int4 dequantizer")
        return None
    target = _cache_dir() / f"dequant-{_digest(_FLAGS, cpu_flags())}.so"
    if not target.exists():
        try:
            _compile(cc, _FLAGS, target)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            logger.info("building the int4 dequantizer failed (%s)", detail)
            return None
    fn = _load(target)
    if fn is not None:
        logger.info("int4 dequantizer: built for this CPU (%s)", target)
    return fn


@functools.lru_cache(maxsize=1)
def native_dequant() -> Dequant | None:
    """The C int4 dequantizer as a function, or None (see the module docstring)."""
    if os.environ.get("RADIXSERVE_NATIVE_KERNELS", "1") == "0":
        logger.info("int4 dequantizer: torch ops (RADIXSERVE_NATIVE_KERNELS=0)")
        return None
    fn = _prebuilt()
    if fn is None:
        fn = _built()
    if fn is None:
        logger.info("int4 dequantizer: torch ops, none prebuilt or built (slower prefill)")
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64]  # fmt: skip
    block = int4_pack_block()  # the layout PyTorch packs in on this machine

    def dequant(packed: torch.Tensor, sz: torch.Tensor, n: int, k: int, group: int) -> torch.Tensor:
        """The (2K, N) bfloat16 hi/lo pair of the weight (see dequant_int4.c)."""
        assert packed.is_contiguous() and sz.is_contiguous() and sz.dtype == torch.bfloat16
        out = torch.empty(2 * k, n, dtype=torch.bfloat16)
        args = (packed.data_ptr(), sz.data_ptr(), out.data_ptr(), n, k, group, block)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Build the portable variants into a directory (for RADIXSERVE_NATIVE_DIR)."""
    parser = argparse.ArgumentParser(
        prog="python -m radixserve.model.native",
        description="Prebuild the int4 dequantizer's portable variants into DIR, for "
        "machines without a C compiler (RADIXSERVE_NATIVE_DIR=DIR).",
    )
    parser.add_argument("dir", type=Path, help="directory to write them to (created)")
    args = parser.parse_args(argv)
    try:
        paths = build_variants(args.dir)
    except subprocess.CalledProcessError as exc:
        print(f"building failed: {' '.join(exc.cmd)}\n{exc.stderr}", file=sys.stderr)
        return 1
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"building failed: {exc}", file=sys.stderr)
        return 1
    for variant, path in zip(variants(), paths):
        needs = " ".join(sorted(variant.cpu_flags)) or "any CPU of this architecture"
        print(f"{variant.name}: {path} (needs {needs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
