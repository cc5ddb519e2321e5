"""Importing radixserve before torch makes OpenMP's idle threads wait passively (so they
leave the cores to the native kernels' threads), unless the environment chose a policy."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = "import radixserve, os, torch; print(os.environ.get('OMP_WAIT_POLICY'))"


def _policy(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    return out.stdout.strip()


def test_passive_unless_the_environment_says_otherwise() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy(env) == "PASSIVE"
    assert _policy({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
