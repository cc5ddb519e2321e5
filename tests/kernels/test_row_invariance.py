"""The torch ops the CPU forward runs besides the native kernels compute each row the same
way whatever the other rows and the threads: RMSNorm with its residual add, rope,
SiLU·mul, log_softmax over the vocabulary, and the dense bfloat16 matmul (the default
model's tied LM head, every matrix with ``quantization=none``).

They are row-wise by nature, but their bits stay put only because PyTorch's CPU kernels
reduce a row in one fixed order and split work across threads by rows (and oneDNN's
bfloat16 GEMM keeps one order per output for any number of rows): measured, not
promised, so this test fails when a PyTorch or oneDNN upgrade changes that
(docs/architecture.md, "Batch invariance")."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels import reference

ROWS = [1, 2, 7, 64, 512]
THREADS = [1, 2, 3]


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _assert_row_invariant(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """Rows 0 and m - 1 of op(x[:m]) are the same bits for every m and thread count."""
    torch.set_num_threads(1)
    whole = _bits(op(x))
    for num_threads in THREADS:
        torch.set_num_threads(num_threads)
        for m in (m for m in ROWS if m <= x.shape[0]):
            part = _bits(op(x[:m].clone()))
            for row in (0, m - 1):
                assert torch.equal(part[row], whole[row]), (m, row, num_threads)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _rows(n: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [576, 4096])
def test_rmsnorm_with_residual(threads, dtype, hidden):
    weight = _rows(1, hidden, dtype)[0]
    x = _rows(max(ROWS), 2 * hidden, dtype, seed=1)  # x and the residual side by side
    _assert_row_invariant(
        lambda t: reference.rmsnorm(t[:, :hidden].contiguous(), weight, 1e-5,
                                    t[:, hidden:].contiguous())[0], x)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_silu_and_log_softmax(threads, dtype):
    positions = torch.arange(max(ROWS)) * 7 % 1000
    cos, sin = _rows(1024, 32, torch.float32, seed=2), _rows(1024, 32, torch.float32, seed=3)

    def rope(t: torch.Tensor) -> torch.Tensor:
        q = t[:, : 9 * 64].reshape(-1, 9, 64).clone()
        k = t[:, 9 * 64 :].reshape(-1, 3, 64).clone()
        reference.rope(q, k, positions[: t.shape[0]], cos, sin)
        return torch.cat((q.flatten(1), k.flatten(1)), dim=1)

    _assert_row_invariant(rope, _rows(max(ROWS), 12 * 64, dtype, seed=4))
    _assert_row_invariant(reference.silu_and_mul, _rows(max(ROWS), 3072, dtype, seed=5))
    logits = _rows(64, 49152, dtype, seed=6)
    _assert_row_invariant(lambda t: torch.log_softmax(t.float(), dim=-1), logits)


@pytest.mark.parametrize("n,k", [(49152, 576), (576, 576), (576, 1536)])
def test_dense_bfloat16_matmul(threads, n, k):
    weight = _rows(n, k, torch.bfloat16, seed=7)
    x = _rows(max(ROWS) if n < 10_000 else 64, k, torch.bfloat16, seed=8)
    _assert_row_invariant(lambda t: F.linear(t, weight), x)
