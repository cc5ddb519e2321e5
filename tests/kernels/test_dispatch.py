"""One kernel set per process: names are validated, "auto" picks triton only on CUDA with
triton importable, and the torch set never imports triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from radixserve.kernels.ops import BACKEND_NAMES, load_ops, resolve_backend
from radixserve.settings import EngineSettings
from tests.kernels.conftest import ON_GPU


def test_registered_sets_share_one_op_table():
    assert BACKEND_NAMES == ("torch", "triton")
    torch_ops, triton_ops = load_ops("torch"), load_ops("triton")
    assert (torch_ops.name, triton_ops.name) == ("torch", "triton")
    with pytest.raises(ValueError, match="unknown kernel backend 'cutlass'"):
        load_ops("cutlass")


def test_auto_is_triton_on_cuda_and_torch_on_cpu():
    assert resolve_backend("auto", "cuda") == "triton"  # triton imports here
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("torch", "cuda") == "torch"
    if not ON_GPU:  # this process runs the kernels in the interpreter
        assert resolve_backend("triton", "cpu") == "triton"
    with pytest.raises(ValueError, match="known: auto, torch, triton"):
        resolve_backend("flash", "cuda")


def test_setting_is_validated_against_the_registered_names(monkeypatch):
    with pytest.raises(ValidationError, match="unknown attention backend 'flash'"):
        EngineSettings(attention_backend="flash")
    monkeypatch.setenv("RADIXSERVE_ATTENTION_BACKEND", "triton")
    assert EngineSettings().attention_backend == "triton"
    assert EngineSettings(attention_backend="torch").attention_backend == "torch"
    with pytest.raises(ValidationError):
        EngineSettings(cuda_graph_max_batch_size=-1)


_FRESH_PROCESS = """
import os, sys, torch
os.environ.pop("TRITON_INTERPRET", None)
from radixserve.errors import ConfigurationError
from radixserve.model.attention import make_attention_backend
backend = make_attention_backend("auto", torch.device("cpu"))
assert backend.name == "torch" and backend.ops.name == "torch"
assert "triton" not in sys.modules, "the torch kernel set imported triton"
try:
    make_attention_backend("triton", torch.device("cpu"))
except ConfigurationError as exc:
    print(exc)
"""


def test_torch_set_never_imports_triton_and_cpu_triton_needs_the_interpreter():
    out = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "TRITON_INTERPRET=1" in out.stdout
