"""How the native CPU kernels are found (`kernels/cpu/native.py`): built for this CPU into
the user's cache, each prebuilt variant this CPU runs (and only those), none without a
compiler or a prebuilt file from these sources; and every variant computes the same bits
in both kernels (AVX-512, AVX2 and plain C add in the same order), so which one a
machine loads changes speed, never a token."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from radixserve.kernels.cpu.attention import native_attention
from radixserve.kernels.cpu.native import native_library, variants
from radixserve.kernels.cpu.qgemm import native_qgemm, pack_bf16, pack_int4, pack_int8

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here: nothing to build")
# (N, K, group): odd numbers of column blocks (tile tails), groups of 32 to 128
SHAPES = [(64, 64, 32), (208, 96, 32), (576, 576, 64), (576, 1536, 32), (128, 256, 128)]
ROWS = [1, 2, 3, 7, 13]  # every row tail of the tiles


def _outputs() -> list[torch.Tensor]:
    """The loaded library's int4, int8 and bfloat16 products of fixed weights and inputs, both
    output dtypes; and its attention over a fixed pool, float32 and bfloat16."""
    kernel, attention = native_qgemm(), native_attention()
    assert kernel is not None and attention is not None
    outs = []
    for n, k, group in SHAPES:
        g = torch.Generator().manual_seed(n + k)
        q4 = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        sz = ((torch.rand(k // group, n, 2, generator=g) - 0.3) * 0.02).to(torch.bfloat16)
        scale = sz[0, :, 0].abs().contiguous()
        for m in ROWS:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            for out in (torch.bfloat16, torch.float32):
                outs.append(kernel.int4(x, pack_int4(q4), sz, group, out))
                outs.append(kernel.int8(x, pack_int8(q8), scale, out))
                outs.append(kernel.bf16(x, pack_bf16(q8.to(torch.bfloat16) * scale[:, None]), out))
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(40, generator=g).view(2, 20)  # (B, W) pages of 4 tokens
    rows = [0, 30, 31, 32, 33]  # one sequence's rows ...
    for dtype in (torch.float32, torch.bfloat16):
        k, v = (torch.randn(40, 4, 2, 64, generator=g).to(dtype) for _ in "kv")
        q = torch.randn(len(rows) + 1, 6, 64, generator=g).to(dtype)
        for window in (0, 9):  # ... and a decode row of the other
            outs.append(attention(q, k, v, table, torch.tensor([0] * len(rows) + [1]),
                                  torch.tensor([*rows, 70]), [0, len(rows), len(rows) + 1],
                                  window, 0.125))  # fmt: skip
    # rows enough that a sum taken in another order shows in the bfloat16 outputs (tens of
    # them differ where a path's q . k adds in another order); 80: a 16-element tail
    for dim in (64, 80):
        k, v = (torch.randn(64, 16, 3, dim, generator=g).to(torch.bfloat16) for _ in "kv")
        q = (torch.randn(96, 9, dim, generator=g) * 2).to(torch.bfloat16)
        pos = torch.arange(96) * 10 + 40
        table = torch.randperm(64, generator=g).view(1, 64)
        outs.append(attention(q, k, v, table, torch.zeros(96, dtype=torch.int64), pos, [0, 96],
                              0, dim**-0.5))  # fmt: skip
    return outs


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)

    return len(a) == len(b) and all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[pytest.MonkeyPatch]:
    """The library found afresh, with an empty user cache; cleared again after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("RADIXSERVE_NATIVE_DIR", raising=False)
    monkeypatch.delenv("RADIXSERVE_NATIVE_KERNELS", raising=False)
    native_library.cache_clear()
    yield monkeypatch
    native_library.cache_clear()


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every variant of this architecture, built by the module's command line."""
    if CC is None:
        pytest.skip("no C compiler here: nothing to prebuild")
    folder = tmp_path_factory.mktemp("native")
    proc = subprocess.run([sys.executable, "-m", "radixserve.kernels.cpu.native", str(folder)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for variant in variants():
        assert (folder / variant.file_name).exists() and variant.name in proc.stdout
    return folder


def _runs_here(cpu_flags: frozenset[str]) -> bool:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return cpu_flags <= set(line.partition(":")[2].split())


def test_variants_are_portable():
    for machine in ("x86_64", "aarch64"):
        for variant in variants(machine):
            assert not any("native" in flag for flag in variant.flags), variant
    assert variants("aarch64")[0].cpu_flags == frozenset()
    assert variants("x86_64")[0].cpu_flags >= {"avx512f", "avx512bw", "avx512_bf16"}
    assert variants("x86_64")[-1].cpu_flags == frozenset()  # a baseline every x86-64 runs


@needs_cc
def test_built_into_the_user_cache(fresh, tmp_path):
    assert native_qgemm() is not None and native_attention() is not None
    assert list((tmp_path / "cache" / "radixserve").glob("kernels-*.so"))
    fresh.setenv("RADIXSERVE_NATIVE_KERNELS", "0")
    native_library.cache_clear()
    assert native_qgemm() is None and native_attention() is None  # off: PyTorch's kernels


def test_no_compiler_and_nothing_prebuilt_leaves_torch(fresh, caplog):
    fresh.setenv("CC", "/nonexistent")
    fresh.setattr("radixserve.kernels.cpu.native.shutil.which", lambda name: None)
    with caplog.at_level(logging.INFO, logger="radixserve.kernels.cpu.native"):
        assert native_qgemm() is None
    assert "PyTorch's kernels" in caplog.text


@pytest.fixture(scope="module")
def native_outputs(tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    """`_outputs` of the library built for this CPU (-march=native) into an empty user
    cache, once for the module's variants."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        patch.delenv("RADIXSERVE_NATIVE_DIR", raising=False)
        patch.delenv("RADIXSERVE_NATIVE_KERNELS", raising=False)
        native_library.cache_clear()
        try:
            return _outputs()
        finally:
            native_library.cache_clear()


@pytest.mark.parametrize("variant", variants(), ids=lambda v: v.name)
def test_each_prebuilt_variant_computes_the_same_bits(
    fresh, prebuilt, native_outputs, tmp_path, variant
):
    """A directory holding only this variant: loaded (no compiler) where this CPU runs it,
    and then bitwise the kernel built for this CPU; refused where it does not."""
    native = native_outputs
    folder = tmp_path / "only"
    folder.mkdir()
    shutil.copy2(prebuilt / variant.file_name, folder / variant.file_name)
    fresh.setenv("RADIXSERVE_NATIVE_DIR", str(folder))
    fresh.setenv("CC", "/nonexistent")
    # only the folder may serve: not the kernel `_outputs` just built into the user cache
    fresh.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    native_library.cache_clear()
    kernel, attention = native_qgemm(), native_attention()
    if not _runs_here(variant.cpu_flags):  # this CPU lacks the variant's features: refused
        assert kernel is None and attention is None
        return
    assert kernel is not None and attention is not None
    paths = {"x86-64-v4-bf16": ("avx512-bf16", "avx512"), "x86-64-v3": ("avx2", "avx2")}
    assert (kernel.path, attention.path) == paths.get(variant.name, ("plain", "plain"))
    assert _same_bits(_outputs(), native)


def test_prebuilt_dir_serves_without_a_compiler(fresh, prebuilt, tmp_path, caplog):
    fresh.setenv("RADIXSERVE_NATIVE_DIR", str(prebuilt))
    fresh.setenv("CC", "/nonexistent")
    with caplog.at_level(logging.INFO, logger="radixserve.kernels.cpu.native"):
        assert native_qgemm() is not None
    best = next(v for v in variants() if _runs_here(v.cpu_flags))
    assert f"prebuilt, {best.name}" in caplog.text
    assert not (tmp_path / "cache" / "radixserve").exists()  # nothing built here


def test_stale_prebuilt_file_is_never_loaded(fresh, prebuilt, tmp_path, caplog):
    """A file built from other sources (another hash in its name) is not used: without
    a compiler that leaves PyTorch's kernels."""
    baseline = variants()[-1]
    stale = tmp_path / "stale"
    stale.mkdir()
    shutil.copy2(
        prebuilt / baseline.file_name, stale / f"kernels-{baseline.name}-0123456789abcdef.so"
    )
    fresh.setenv("RADIXSERVE_NATIVE_DIR", str(stale))
    fresh.setenv("CC", "/nonexistent")
    with caplog.at_level(logging.INFO, logger="radixserve.kernels.cpu.native"):
        assert native_qgemm() is None
    assert "holds no native CPU kernels" in caplog.text and "PyTorch's kernels" in caplog.text


def test_a_cpu_without_the_extensions_gets_the_baseline(fresh, prebuilt, caplog):
    """The best variant whose CPU flags are all listed: here none but the baseline's."""
    fresh.setattr("radixserve.kernels.cpu.native.cpu_flags", lambda: "flags\t\t: fpu sse sse2")
    fresh.setenv("RADIXSERVE_NATIVE_DIR", str(prebuilt))
    fresh.setenv("CC", "/nonexistent")
    with caplog.at_level(logging.INFO, logger="radixserve.kernels.cpu.native"):
        kernel = native_qgemm()
    assert kernel is not None and kernel.path == "plain"
    assert f"prebuilt, {variants()[-1].name} " in caplog.text
