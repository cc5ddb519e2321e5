"""The batched LoRA matmul (`lora_apply`) in all three sets: the reference against a plain
per-row formula; the native CPU kernel and the Triton kernel (in the interpreter on CPU)
equal to the reference bit for bit, over both dtypes, ranks 8 to 64, zero-padded
lower-rank adapters, base rows (slot -1) and y as a column slice of a wider output; and
batch-invariant: a row's bits alone equal its bits among other adapters' rows, whatever
the threads. The native cases are skipped where no C compiler is (the torch set then runs
the reference)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from radixserve.kernels.cpu import lora as cpu_lora
from radixserve.kernels.cpu.lora import NativeLora, native_lora
from radixserve.kernels.cpu.lora import lora_apply as cpu_lora_apply
from radixserve.kernels.cpu.native import cpu_flags, variants
from radixserve.kernels.ops import load_ops
from radixserve.kernels.reference.lora import lora_apply as reference_lora_apply
from tests.kernels.conftest import TRITON

DTYPES = [torch.bfloat16, torch.float32]
DTYPE_IDS = ["bf16", "fp32"]
PAD = 3  # columns of the wide output on each side of y

needs_native = pytest.mark.skipif(
    native_lora() is None, reason="no C compiler here: no native kernel (the reference runs)"
)


@dataclass
class Case:
    """One call's arguments; y is a column slice of `wide`."""

    x: torch.Tensor  # (N, K)
    wide: torch.Tensor  # (N, PAD + M + PAD)
    a: torch.Tensor  # (L, R, K)
    b: torch.Tensor  # (L, M, R)
    row_slot: torch.Tensor  # (N,)
    scaling: torch.Tensor  # (L,)

    @property
    def y(self) -> torch.Tensor:
        return self.wide[:, PAD:-PAD]

    def run(self, op: Callable[..., None], b: torch.Tensor | None = None) -> torch.Tensor:
        """The wide output after `op` on a copy of it (this case's is kept)."""
        wide = self.wide.clone()
        b = self.b if b is None else b
        op(self.x, wide[:, PAD:-PAD], self.a, b, self.row_slot, self.scaling)
        return wide

    def rows(self, index: list[int]) -> Case:
        """The same call on a subset of the rows (same adapters)."""
        ids = torch.tensor(index)
        return Case(self.x[ids], self.wide[ids], self.a, self.b, self.row_slot[ids], self.scaling)

    def to(self, device: torch.device) -> Case:
        return Case(*(t.to(device) for t in (self.x, self.wide, self.a, self.b,
                                             self.row_slot, self.scaling)))  # fmt: skip


def make_case(slots: list[int], k: int, m: int, num_slots: int, rank: int,
              dtype: torch.dtype, seed: int = 0) -> Case:  # fmt: skip
    """Rows of the given slots; adapter 1 (if any) of half the rank, zero-padded."""
    g = torch.Generator().manual_seed(seed)
    n = len(slots)
    a = torch.randn(num_slots, rank, k, generator=g) * k**-0.5
    b = torch.randn(num_slots, m, rank, generator=g) * rank**-0.5
    if num_slots > 1:
        a[1, rank // 2 :] = 0
        b[1, :, rank // 2 :] = 0
    return Case(
        x=torch.randn(n, k, generator=g).to(dtype),
        wide=torch.randn(n, PAD + m + PAD, generator=g).to(dtype),
        a=a.to(dtype),
        b=b.to(dtype),
        row_slot=torch.tensor(slots, dtype=torch.int64),
        scaling=torch.rand(num_slots, generator=g) + 0.5,
    )


def per_row(case: Case, slots: torch.Tensor) -> torch.Tensor:
    """The wide output by the op's formula, row by row, sums in float64: t rounded to the
    dtype, the update added in float32 and rounded."""
    out = case.wide.clone()
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        t = (case.a[s].double() @ case.x[i].double()).float().to(case.x.dtype)
        delta = case.scaling[s].double() * (case.b[s].double() @ t.double())
        out[i, PAD:-PAD] = (case.y[i].float() + delta.float()).to(case.x.dtype)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a zero's sign and NaN payloads included)."""
    ints = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


SLOTS = [0, -1, 2, 1, 0, -1, 3, 2, 2]  # four adapters and base rows, interleaved


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_reference_follows_the_per_row_formula(dtype):
    case = make_case(SLOTS, 200, 96, 4, 16, dtype)
    got = case.run(reference_lora_apply)
    # within the rounding of float32 sums against float64 ones: at most one unit of the
    # dtype's last place, once in t and once in y
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got, per_row(case, case.row_slot), atol=tol, rtol=tol)
    base = case.row_slot < 0
    assert torch.equal(got[base], case.wide[base])  # base rows untouched
    assert torch.equal(got[:, :PAD], case.wide[:, :PAD])  # and the columns outside y
    assert torch.equal(got[:, -PAD:], case.wide[:, -PAD:])
    # the comparison sees a row given another adapter
    wrong = case.row_slot.clone()
    wrong[0] = 1
    assert not torch.allclose(got.float(), per_row(case, wrong).float(), atol=tol, rtol=tol)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("k,m", [(64, 576), (576, 96), (200, 70)])
def test_native_equals_reference(dtype, rank, k, m):
    case = make_case(SLOTS, k, m, 4, rank, dtype, seed=rank + k)
    expected = case.run(reference_lora_apply)
    assert not torch.equal(expected, case.wide)
    assert same_bits(case.run(cpu_lora_apply), expected)
    # B stored (L, R, M) and passed transposed: the same bits
    b_columns = case.b.transpose(1, 2).contiguous().transpose(1, 2)
    assert same_bits(case.run(cpu_lora_apply, b_columns), expected)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_native_zero_updates_keep_the_references_signed_zeros(dtype):
    """Columns of B all zero with every t negative: each product is -0, and the dot, as
    the reference sums it from +0, is +0, so a y of -0 becomes +0 (-0 + +0) and any other
    y stays; the native kernel's sums start from the products themselves and must end at
    the same zero."""
    case = make_case(SLOTS, 64, 48, 4, 16, dtype, seed=5)
    case.x = case.x.abs()
    case.a = -case.a.abs()  # t = a @ x < 0
    case.b[:, ::2] = 0  # every other column: zero updates
    case.wide[:, ::3] = -0.0
    expected = case.run(reference_lora_apply)
    flipped = torch.signbit(case.wide) & ~torch.signbit(expected)  # -0 became +0
    assert flipped.any()
    assert same_bits(case.run(cpu_lora_apply), expected)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_every_variant_computes_the_same_bits(tmp_path: Path):
    """`lora.c` built with each portable variant's flags this CPU runs (AVX-512, AVX2,
    the baseline: different vector widths, never a fused multiply-add) and for this CPU."""
    have = set(cpu_flags().partition(":")[2].split())
    builds = [v.flags for v in variants() if v.cpu_flags <= have] + [("-O3", "-march=native",
                                                                     "-shared", "-fPIC")]  # fmt: skip
    cases = [make_case(SLOTS, 200, 70, 4, rank, dtype, seed=rank)
             for rank in (8, 64) for dtype in DTYPES]  # fmt: skip
    expected = [case.run(reference_lora_apply) for case in cases]
    for i, flags in enumerate(builds):
        lib = tmp_path / f"lora{i}.so"
        source = Path(cpu_lora.__file__).with_name("lora.c")
        subprocess.run(["cc", *flags, str(source), "-o", str(lib)], check=True, timeout=120,
                       capture_output=True)  # fmt: skip
        kernel = NativeLora(ctypes.CDLL(str(lib)))
        for case, want in zip(cases, expected):
            assert same_bits(case.run(kernel), want), flags


@needs_native
def test_the_torch_set_runs_the_native_kernel():
    case = make_case(SLOTS, 64, 48, 4, 8, torch.bfloat16)
    assert load_ops("torch").lora_apply is cpu_lora_apply
    expected = case.run(reference_lora_apply)
    assert same_bits(case.run(load_ops("torch").lora_apply), expected)
    wrong = case.rows(list(range(len(SLOTS))))
    wrong.row_slot = wrong.row_slot.roll(1)  # every row on its neighbour's adapter
    assert not torch.equal(wrong.run(cpu_lora_apply), expected)


def test_without_the_native_library_the_reference_runs(monkeypatch):
    case = make_case(SLOTS, 64, 48, 4, 8, torch.float32)
    calls = []
    monkeypatch.setattr(cpu_lora, "native_lora", lambda: None)
    monkeypatch.setattr(cpu_lora, "reference_lora_apply", lambda *args: calls.append(args))
    case.run(cpu_lora_apply)
    assert len(calls) == 1


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_native_rows_do_not_depend_on_the_batch(dtype, threads):
    """128 rows of four adapters, split over two threads (the split starts at this size),
    against each row alone and in another order."""
    slots = [(i * 7) % 5 - 1 for i in range(128)]
    case = make_case(slots, 1024, 1024, 4, 64, dtype, seed=1)
    torch.set_num_threads(2)
    batch = case.run(cpu_lora_apply)
    for i in (0, 1, 2, 3, 4, 127):
        assert torch.equal(case.rows([i]).run(cpu_lora_apply), batch[i : i + 1]), i
    order = list(range(127, -1, -2)) + list(range(0, 128, 2))
    assert torch.equal(case.rows(order).run(cpu_lora_apply), batch[torch.tensor(order)])


@pytest.mark.parametrize("op", ["reference", "triton"])
def test_rows_do_not_depend_on_the_batch(op, device):
    lora_apply = reference_lora_apply if op == "reference" else TRITON.OPS.lora_apply
    case = make_case(SLOTS, 96, 80, 4, 16, torch.bfloat16, seed=2).to(device)
    batch = case.run(lora_apply)
    for i in range(len(SLOTS)):
        assert torch.equal(case.rows([i]).run(lora_apply), batch[i : i + 1]), i


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rank,k,m", [(8, 64, 96), (16, 200, 70), (64, 48, 130)])
def test_triton_equals_reference(device, dtype, rank, k, m):
    """Bit for bit: the kernel adds in the reference's order and rounds bfloat16 as it."""
    case = make_case(SLOTS, k, m, 4, rank, dtype, seed=rank)
    expected = case.run(reference_lora_apply)
    on_device = case.to(device)
    assert same_bits(on_device.run(TRITON.OPS.lora_apply).cpu(), expected)
    b_columns = on_device.b.transpose(1, 2).contiguous().transpose(1, 2)
    assert same_bits(on_device.run(TRITON.OPS.lora_apply, b_columns).cpu(), expected)


def test_triton_leaves_rows_of_unknown_slots_alone(device):
    case = make_case([0, 4, -2, 1], 32, 40, 2, 8, torch.float32).to(device)
    got = case.run(TRITON.OPS.lora_apply)
    assert torch.equal(got[1:3], case.wide[1:3])
    assert not torch.equal(got[0], case.wide[0]) and not torch.equal(got[3], case.wide[3])


@pytest.mark.parametrize("op", [reference_lora_apply, cpu_lora_apply], ids=["reference", "cpu"])
def test_bad_arguments_are_refused(op):
    case = make_case([0, 1], 32, 40, 2, 8, torch.bfloat16)
    for slots, match in (([0, 2], r"\[-1, 2\)"), ([-2, 0], r"\[-1, 2\)")):
        with pytest.raises(ValueError, match=match):
            op(case.x, case.y, case.a, case.b, torch.tensor(slots), case.scaling)
    with pytest.raises(ValueError, match="one dtype"):
        op(case.x.float(), case.y, case.a, case.b, case.row_slot, case.scaling)
    with pytest.raises(ValueError, match="shapes"):
        op(case.x, case.y, case.a, case.b[:, :-1], case.row_slot, case.scaling)
    with pytest.raises(ValueError, match="scaling"):
        op(case.x, case.y, case.a, case.b, case.row_slot, case.scaling.double())


def test_triton_refuses_bad_arguments(device):
    case = make_case([0, 1], 32, 40, 2, 8, torch.bfloat16).to(device)
    with pytest.raises(ValueError, match="dtypes differ"):
        TRITON.OPS.lora_apply(case.x, case.y, case.a, case.b.float(), case.row_slot,
                              case.scaling)  # fmt: skip
    with pytest.raises(ValueError, match="b has shape"):
        TRITON.OPS.lora_apply(case.x, case.y, case.a, case.b[:, :-1], case.row_slot,
                              case.scaling)  # fmt: skip
