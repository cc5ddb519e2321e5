"""The CPU kernel set's C kernels: prebuilt, or built on first use.

The kernels share one library, each batch-invariant (each output row is computed by a
fixed sequence of operations whatever the other rows, the chunking or the threads; the
arithmetic is written out at the top of each source):

- `qgemm.c`: the quantized GEMM (`radixserve.kernels.cpu.qgemm.native_qgemm`) that
  `Int4Linear` and `Int8Linear` run for every number of rows, and its bfloat16 sibling
  for a dense LM head;
- `attention.c`: paged attention (`radixserve.kernels.cpu.attention`) for extend and
  decode rows alike;
- `decode.c`: a whole decode step of the model's layers in one call over preallocated
  buffers (`radixserve.kernels.cpu.decode`), built from the two above.
- `lora.c`: the batched LoRA matmul of multi-LoRA serving
  (`radixserve.kernels.cpu.lora`), equal bit for bit to its reference.

They link no OpenMP runtime of their own (a second one beside torch's in the same
process is asking for trouble): work runs on a small thread pool (ctypes releases the
GIL), split only where it does not change a bit (`radixserve.kernels.cpu.threads`).

Where the library comes from, first found wins (logged once, at INFO):

1. ``$RADIXSERVE_NATIVE_DIR``: a directory of prebuilt variants, written by
   ``python -m radixserve.kernels.cpu.native DIR`` where a compiler is (an image's build
   stage: its runtime stage has none). The best variant whose CPU flags
   ``/proc/cpuinfo`` lists is loaded: on x86-64, AVX-512 with bfloat16 (x86-64-v4 +
   avx512bf16: ``vdpbf16ps``), AVX2 (x86-64-v3: float32 FMAs) or the x86-64 baseline
   (plain C); elsewhere one baseline. They are built with portable flags only, never
   ``-march=native`` (an image runs on other CPUs than the one that built it), and named
   by variant and a hash of the sources and flags, so a file built from another version
   of the sources is never loaded.
2. Built on first use with the system C compiler (``cc``, or ``$CC``) into the user's
   cache (``$XDG_CACHE_HOME/radixserve``, else ``~/.cache/radixserve``), once per source
   and CPU (``-march=native``: the file name carries a hash of both), written atomically
   so that workers starting together do not race.
3. None: the layers run PyTorch's weight-only kernels and attention its SDPA paths
   (`radixserve.model.qlinear`, `radixserve.kernels.cpu`): slower prefill, and a greedy
   answer may then depend on how its tokens were batched, chunked or cached.

Every variant computes the same bits (the paths add in the same order:
tests/kernels/test_native.py), so which one a machine loads changes speed, never a
token. ``RADIXSERVE_NATIVE_KERNELS=0`` turns the library off.
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# the kernels themselves, shipped beside this module (package data)
_SOURCES = {
    name: (Path(__file__).parent / name).read_text()
    for name in ("qgemm.c", "attention.c", "decode.c", "lora.c")
}
_SOURCE = "".join(_SOURCES.values())  # what the file names' hash covers
_COMMON_FLAGS = ("-O3", "-shared", "-fPIC")
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")  # built on first use, for this CPU
_LIBS = ("-lm",)  # fmaf where the CPU has no FMA


@dataclass(frozen=True)
class Variant:
    """A portable build of the kernel: its compiler flags and the CPU flags (as
    /proc/cpuinfo names them) that the code those flags allow needs."""

    name: str
    flags: tuple[str, ...]
    cpu_flags: frozenset[str] = frozenset()

    @property
    def file_name(self) -> str:
        return f"kernels-{self.name}-{_digest(self.flags)}.so"


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
    """Compile the sources into ``target``, atomically (raises on failure)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        sources = []
        for name, text in _SOURCES.items():
            sources.append(Path(tmp) / name)
            sources[-1].write_text(text)
        lib = Path(tmp) / "kernels.so"
        subprocess.run([cc, *flags, *map(str, sources), "-o", str(lib), *_LIBS], check=True,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
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


def _load(path: Path) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        logger.info("loading %s failed (%s)", path, exc)
        return None


def _prebuilt() -> ctypes.CDLL | None:
    """The best prebuilt variant in $RADIXSERVE_NATIVE_DIR this CPU runs, if any."""
    folder = os.environ.get("RADIXSERVE_NATIVE_DIR")
    if not folder:
        return None
    have = set(cpu_flags().partition(":")[2].split())
    for variant in variants():
        path = Path(folder) / variant.file_name
        if variant.cpu_flags <= have and path.exists() and (lib := _load(path)) is not None:
            logger.info("native CPU kernels: prebuilt, %s (%s)", variant.name, path)
            return lib
    logger.warning("RADIXSERVE_NATIVE_DIR=%s holds no native CPU kernels built from these "
                   "sources that this CPU runs (python -m radixserve.kernels.cpu.native DIR)",
                   folder)  # fmt: skip
    return None


def _built() -> ctypes.CDLL | None:
    """The library built for this CPU in the user's cache (building it if needed)."""
    cc = _compiler()
    if cc is None:
        logger.debug("no C compiler to build the native CPU kernels")
        return None
    target = _cache_dir() / f"kernels-{_digest(_FLAGS, cpu_flags())}.so"
    if not target.exists():
        try:
            _compile(cc, _FLAGS, target)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            logger.info("building the native CPU kernels failed (%s)", detail)
            return None
    lib = _load(target)
    if lib is not None:
        logger.info("native CPU kernels: built for this CPU (%s)", target)
    return lib


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The library, or None (see the module docstring)."""
    if os.environ.get("RADIXSERVE_NATIVE_KERNELS", "1") == "0":
        logger.info("native CPU kernels: off (RADIXSERVE_NATIVE_KERNELS=0), PyTorch's instead")
        return None
    lib = _prebuilt() or _built()
    if lib is None:
        logger.warning("native CPU kernels: none prebuilt or built, PyTorch's kernels instead "
                       "(slower prefill, and greedy answers may depend on batching)")  # fmt: skip
    return lib


def main(argv: Sequence[str] | None = None) -> int:
    """Build the portable variants into a directory (for RADIXSERVE_NATIVE_DIR)."""
    parser = argparse.ArgumentParser(
        prog="python -m radixserve.kernels.cpu.native",
        description="Prebuild the native CPU kernels' portable variants into DIR, for "
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
