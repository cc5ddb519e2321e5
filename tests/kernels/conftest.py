"""The Triton kernels under test: native on a CUDA machine, in Triton's CPU interpreter
otherwise (see `interpreter.py`; `tests/conftest.py` imports them first). The interpreter
switch is on during each test of this directory only."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.kernels.interpreter import ON_GPU, import_kernels, interpreter

TRITON = import_kernels()
__all__ = ["ON_GPU", "TRITON"]


@pytest.fixture(autouse=True)
def _triton_interpreter() -> Iterator[None]:
    with interpreter():
        yield


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")
