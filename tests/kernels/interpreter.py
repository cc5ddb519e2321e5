"""How this test process runs the Triton kernels: natively where CUDA is present, else in
Triton's CPU interpreter.

TRITON_INTERPRET is read when `triton.jit` decorates a function — Triton's own library
functions (`tl.zeros`, `tl.sum`, ...) when triton is first imported, and ours when
`radixserve.kernels.triton` is — and again while an interpreted kernel runs. transformers
imports triton (through accelerate and torch._dynamo), so `tests/conftest.py` calls
`import_kernels` before any test module is imported. The variable is set only around that
import and, by `tests/kernels/conftest.py`, during each test of that directory: nothing
else, and no process a test starts, sees it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

ON_GPU = torch.cuda.is_available()


@contextmanager
def interpreter() -> Iterator[None]:
    """TRITON_INTERPRET=1 for the duration (nothing on a CUDA machine)."""
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


def import_kernels() -> ModuleType:
    """`radixserve.kernels.triton`, imported (with triton) in the mode this process needs."""
    fresh = "triton" not in sys.modules
    with interpreter():
        import triton.language.standard as standard
        from triton.runtime.interpreter import InterpretedFunction

        import radixserve.kernels.triton as kernels
    interpreted = isinstance(standard.zeros, InterpretedFunction)
    if (kernels.INTERPRETED, interpreted) != (not ON_GPU, not ON_GPU):
        raise RuntimeError(
            "triton was imported before the test setup could choose how it runs "
            f"(imported first here: {fresh}); tests/conftest.py must run import_kernels first"
        )
    return kernels
