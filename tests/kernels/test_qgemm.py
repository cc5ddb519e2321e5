"""The quantized GEMM (`kernels/cpu/qgemm.c`) against its specification
(`kernels/reference/qgemm.py`): within one bfloat16 rounding of the exact product at 1 to
512 rows, for every matrix shape of the default model and an 8B one; and batch-invariant:
a row's output is the same bits alone or among any other rows, on any number of threads.
Where no C compiler is, there is no kernel to test and these are skipped (the layers then
run PyTorch's kernels: tests/engine/test_native_fallback.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from radixserve.kernels.cpu import qgemm as qgemm_module
from radixserve.kernels.cpu.native import native_library
from radixserve.kernels.cpu.qgemm import QGemm, native_qgemm, pack_bf16, pack_int4, pack_int8
from radixserve.kernels.reference.qgemm import exact_product, int4_weight, int8_weight

# (N, K): SmolLM2-135M's fused qkv, o, fused gate/up and down projections
DEFAULT_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
SHAPE_8B = (4096, 14336)  # Llama-3-8B's down projection: the longest sums of an 8B model
ROWS = [1, 4, 16, 64, 256, 512]
BF16_ROUNDING = 2.0**-8  # the relative error of one rounding to bfloat16 (8-bit significand)
SUM_SLACK = 2.0**-18  # float32 sums: their error against the magnitude |x| @ |w|.T


@pytest.fixture(scope="module")
def kernel() -> QGemm:
    native_library.cache_clear()
    found = native_qgemm()
    if found is None:
        pytest.skip("no C compiler here: no native kernel (the layers run PyTorch's)")
    return found


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _int4(n: int, k: int, group: int = 32, seed: int = 0):
    """Codes, (K/group, N, 2) scales and zeros as a checkpoint's: scales ~ 0.01, zeros
    around 0 (so that rows of opposite signs cancel, as in real layers)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(k // group, n, generator=g) * 0.02 + 1e-3
    zero = (torch.rand(k // group, n, generator=g) - 0.5) * 0.02
    return q, torch.stack((scale, zero), dim=-1).to(torch.bfloat16)


def _x(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    """Activations with a few large columns, as hidden states have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, torch.randint(0, k, (k // 64,), generator=g)] *= 20
    return x.to(torch.bfloat16)


def _assert_within_one_rounding(y: torch.Tensor, exact: torch.Tensor, mag: torch.Tensor):
    err = (y.double() - exact).abs()
    bound = (BF16_ROUNDING if y.dtype == torch.bfloat16 else 0.0) * exact.abs() + SUM_SLACK * mag
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the bound (one bfloat16 rounding)"


@pytest.mark.parametrize("n,k", [*DEFAULT_SHAPES, SHAPE_8B], ids=lambda v: str(v))
def test_int4_within_one_rounding_of_the_exact_product(kernel, n, k):
    q, sz = _int4(n, k)
    packed = pack_int4(q)
    x = _x(max(ROWS), k)
    cols = torch.randperm(n, generator=torch.Generator().manual_seed(2))[:512]  # reference's
    exact, mag = exact_product(x, int4_weight(q[cols], sz[:, cols], 32))
    for rows in ROWS:
        for out in (torch.bfloat16, torch.float32):
            y = kernel.int4(x[:rows], packed, sz, 32, out)
            assert y.shape == (rows, n) and y.dtype == out
            _assert_within_one_rounding(y[:, cols], exact[:rows], mag[:rows])


@pytest.mark.parametrize("n,k", [(576, 1536), (200, 96), (49152, 64)])
def test_int8_within_one_rounding_of_the_exact_product(kernel, n, k):
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) * 0.01 + 1e-4).to(torch.bfloat16)
    n_pad = -(-n // 16) * 16  # as Int8Linear pads: zero codes and scales
    packed = pack_int8(torch.cat((q, q.new_zeros(n_pad - n, k))))
    scale_pad = torch.cat((scale, scale.new_zeros(n_pad - n)))
    x = _x(64, k)
    exact, mag = exact_product(x, int8_weight(q, scale))
    for rows in (1, 3, 64):
        for out in (torch.bfloat16, torch.float32):
            y = kernel.int8(x[:rows], packed, scale_pad, out)[:, :n]
            _assert_within_one_rounding(y, exact[:rows], mag[:rows])


@pytest.mark.parametrize("n,k", [(49152, 576), (208, 96)])
def test_bf16_within_one_rounding_of_the_exact_product(kernel, n, k):
    """The dense bfloat16 GEMM (the LM head's: SmolLM2's 49,152 x 576, and a tile tail)."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    packed = pack_bf16(w)
    x = _x(64, k)
    cols = torch.randperm(n, generator=g)[:512]
    exact, mag = exact_product(x, w[cols].double())
    for rows in (1, 3, 7, 64):
        for out in (torch.bfloat16, torch.float32):
            y = kernel.bf16(x[:rows], packed, out)
            assert y.shape == (rows, n) and y.dtype == out
            _assert_within_one_rounding(y[:, cols], exact[:rows], mag[:rows])


def _batches(row: torch.Tensor, others: int, seed: int) -> list[tuple[torch.Tensor, int]]:
    """`row` (1, K) placed first, in the middle and last among `others` other rows."""
    rest = _x(others, row.shape[1], seed=seed)
    return [(torch.cat((rest[:at], row, rest[at:])), at) for at in sorted({0, others // 2, others})]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("scheme", ["int4", "int8", "bf16"])
def test_a_row_is_the_same_bits_alone_or_among_others(kernel, threads, monkeypatch, scheme):
    """Alone, among 1, 7, 64 and 511 others (first, middle, last), on 1, 2 and 3 threads
    with calls split over threads even when small: the same bits, both output dtypes."""
    n, k = 576, 1536
    q, sz = _int4(n, k, seed=3)
    q8 = (q.to(torch.int16) * 17 - 127).to(torch.int8)  # any int8 codes
    scale8 = sz[0, :, 0].contiguous()
    w16 = (q.to(torch.float32) - 8).to(torch.bfloat16) * sz[0, :, :1]
    packed = {"int4": pack_int4(q), "int8": pack_int8(q8), "bf16": pack_bf16(w16)}[scheme]

    def run(x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        if scheme == "int4":
            return kernel.int4(x, packed, sz, 32, out)
        if scheme == "bf16":
            return kernel.bf16(x, packed, out)
        return kernel.int8(x, packed, scale8, out)

    monkeypatch.setattr(qgemm_module, "_SPLIT_MACS", 0)
    row = _x(1, k, seed=4)
    for out in (torch.bfloat16, torch.float32):
        torch.set_num_threads(1)
        alone = _bits(run(row, out)[0])
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            assert torch.equal(_bits(run(row, out)[0]), alone)
            for others in (1, 7, 64, 511):
                for batch, at in _batches(row, others, seed=others + num_threads):
                    together = _bits(run(batch, out)[at])
                    assert torch.equal(together, alone), (out, others, at, num_threads)


def test_packing_is_a_permutation(kernel):
    """Packed codes read back (through the kernel with one-hot inputs) as the codes."""
    n, k = 32, 64
    q, _ = _int4(n, k, seed=5)
    ones = torch.ones(k // 32, n, 2, dtype=torch.bfloat16)
    ones[..., 1] = 0  # w = q - 8
    eye = torch.eye(k).to(torch.bfloat16)
    w = kernel.int4(eye, pack_int4(q), ones, 32, torch.float32)  # (K, N): row i is input i
    assert torch.equal(w.t(), q.float() - 8)
