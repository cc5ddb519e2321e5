"""Which device an engine runs on: a device asked for by name that the process cannot
see is refused at start with a message naming it (the CUDA image on a host without a
GPU), never a crash deep inside the first tensor allocation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from radixserve.engine.device import resolve_device
from radixserve.errors import ConfigurationError


def test_auto_and_cpu_resolve_to_what_is_there() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: nothing to refuse")
def test_cuda_without_a_gpu_is_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match=r"device 'cuda'.*RADIXSERVE_DEVICE=cpu"):
        resolve_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: nothing to refuse")
def test_a_worker_asked_for_cuda_without_one_exits_with_the_reason() -> None:
    env = {"RADIXSERVE_DEVICE": "cuda", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "decode"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "error: device 'cuda' asked for" in done.stderr
    assert "Traceback" not in done.stderr
