"""The native int4 dequantizer (`radixserve.model.native`): every way of getting it (built
for this CPU, each prebuilt variant this CPU runs) and the torch-ops path without it give
the same [hi | lo] pair, bit for bit, so a prefill's tokens do not depend on which one a
machine has; and a prebuilt directory serves where there is no compiler."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from radixserve.model.native import native_dequant, variants
from radixserve.model.qlinear import Int4Linear
from radixserve.model.quant import quantize

CPU = torch.device("cpu")
CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here: no native routine to compare")
# (N, K, group, weight scale): the default model's 576 / 1536 projections both ways,
# others, and weights near float32's subnormals (AVX-512's bfloat16 conversion flushes
# those to zero: the routine must redo them in plain C)
SHAPES = [(64, 64, 32, 0.05), (192, 96, 32, 0.05), (576, 576, 64, 0.05), (576, 1536, 32, 0.05),
          (1536, 576, 32, 0.05), (128, 1536, 128, 0.05), (64, 128, 32, 1e-38)]  # fmt: skip


def _layer(n: int, k: int, group: int, scale: float) -> Int4Linear:
    torch.manual_seed(n * 7 + k + group)
    layer = Int4Linear(n, k, torch.bfloat16, CPU, group)
    layer.load(0, quantize(torch.randn(n, k) * scale, "int4", group))
    return layer


def _torch_ops_pair(layer: Int4Linear) -> torch.Tensor:
    native, layer._native = layer._native, None
    try:
        return layer.dense_pair()
    finally:
        layer._native = native


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.stride() == b.stride()  # the same matmul call
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[pytest.MonkeyPatch]:
    """native_dequant found afresh, with an empty user cache; cleared again after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("RADIXSERVE_NATIVE_DIR", raising=False)
    monkeypatch.delenv("RADIXSERVE_NATIVE_KERNELS", raising=False)
    native_dequant.cache_clear()
    yield monkeypatch
    native_dequant.cache_clear()


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every variant of this architecture, built by the module's command line."""
    if CC is None:
        pytest.skip("no C compiler here: nothing to prebuild")
    folder = tmp_path_factory.mktemp("native")
    proc = subprocess.run([sys.executable, "-m", "radixserve.model.native", str(folder)],
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
@pytest.mark.parametrize("n,k,group,scale", SHAPES)
def test_torch_ops_pair_is_the_native_one_bitwise(fresh, n, k, group, scale):
    """Built for this CPU (-march=native) against torch ops."""
    assert native_dequant() is not None
    layer = _layer(n, k, group, scale)
    assert layer._native is not None
    _assert_bitwise(layer.dense_pair(), _torch_ops_pair(layer))


@pytest.mark.parametrize("variant", variants(), ids=lambda v: v.name)
def test_each_prebuilt_variant_gives_the_torch_ops_pair(fresh, prebuilt, tmp_path, variant):
    """A directory holding only this variant: loaded (no compiler) where this CPU runs it,
    and then bitwise the torch-ops pair; refused where it does not."""
    folder = tmp_path / "only"
    folder.mkdir()
    shutil.copy2(prebuilt / variant.file_name, folder / variant.file_name)
    fresh.setenv("RADIXSERVE_NATIVE_DIR", str(folder))
    fresh.setenv("CC", "/nonexistent")
    dequant = native_dequant()
    if not _runs_here(variant.cpu_flags):
        assert dequant is None
        pytest.skip(f"this CPU lacks {sorted(variant.cpu_flags)}: refused, as it should be")
    assert dequant is not None
    for n, k, group, scale in SHAPES:
        layer = _layer(n, k, group, scale)
        _assert_bitwise(dequant(layer.packed, layer.scales_zeros, n, k, group).t(),
                        _torch_ops_pair(layer))  # fmt: skip


def test_prebuilt_dir_serves_without_a_compiler(fresh, prebuilt, tmp_path, caplog):
    fresh.setenv("RADIXSERVE_NATIVE_DIR", str(prebuilt))
    fresh.setenv("CC", "/nonexistent")
    with caplog.at_level(logging.INFO, logger="radixserve.model.native"):
        assert native_dequant() is not None
    best = next(v for v in variants() if _runs_here(v.cpu_flags))
    assert f"prebuilt, {best.name}" in caplog.text
    assert not (tmp_path / "cache" / "radixserve").exists()  # nothing built here


def test_stale_prebuilt_file_is_never_loaded(fresh, prebuilt, tmp_path, caplog):
    """A file built from another source (another hash in its name) is not used: without
    a compiler that leaves torch ops."""
    baseline = variants()[-1]
    stale = tmp_path / "stale"
    stale.mkdir()
    shutil.copy2(
        prebuilt / baseline.file_name, stale / f"dequant-{baseline.name}-0123456789abcdef.so"
    )
    fresh.setenv("RADIXSERVE_NATIVE_DIR", str(stale))
    fresh.setenv("CC", "/nonexistent")
    with caplog.at_level(logging.INFO, logger="radixserve.model.native"):
        assert native_dequant() is None
    assert "holds no int4 dequantizer" in caplog.text and "torch ops" in caplog.text


def test_a_cpu_without_the_extensions_gets_the_baseline(fresh, prebuilt, caplog):
    """The best variant whose CPU flags are all listed: here none but the baseline's."""
    fresh.setattr("radixserve.model.native.cpu_flags", lambda: "flags\t\t: fpu sse sse2")
    fresh.setenv("RADIXSERVE_NATIVE_DIR", str(prebuilt))
    fresh.setenv("CC", "/nonexistent")
    with caplog.at_level(logging.INFO, logger="radixserve.model.native"):
        assert native_dequant() is not None
    assert f"prebuilt, {variants()[-1].name} " in caplog.text
