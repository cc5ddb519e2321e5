"""radixserve: LLM serving with a radix-indexed, tiered KV cache."""

import os
import sys

__version__ = "0.1.0"

# OpenMP's idle threads wait passively unless the user chose otherwise. Left to spin
# (libgomp's default), torch's OpenMP threads hold the cores for a while after each of
# torch's parallel ops, and the native kernels' threads that run next (GEMM, attention)
# wait for those cores: on 2 cores a 1,500-token prefill took 2.9 s instead of 1.9 s.
# libgomp reads the setting when torch loads it, so this must run before torch is
# imported (radixserve's own entry points import this package first); in a process
# that imported torch already, set OMP_WAIT_POLICY=PASSIVE in its environment.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
