"""The Triton kernels under test: native on a CUDA machine, in Triton's CPU interpreter
otherwise.

`triton.jit` reads TRITON_INTERPRET when it decorates a kernel, and the interpreter reads
it again while running one (lazy imports, constexpr helpers), so the variable is set
around the first import of `radixserve.kernels.triton` and during each test of this
directory, and unset again after each: tests elsewhere, and the processes they start,
never see it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

ON_GPU = torch.cuda.is_available()


@contextmanager
def _interpreter() -> Iterator[None]:
    if ON_GPU:
        yield
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _import_kernels():
    with _interpreter():
        import radixserve.kernels.triton as kernels
    if kernels.INTERPRETED == ON_GPU:
        raise RuntimeError(
            "radixserve.kernels.triton was imported before tests/kernels/conftest.py could "
            "choose how it runs; run these tests in their own process"
        )
    return kernels


TRITON = _import_kernels()


@pytest.fixture(autouse=True)
def _triton_interpreter() -> Iterator[None]:
    with _interpreter():
        yield


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")
