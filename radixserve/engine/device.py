"""Where an engine runs and in which dtype, decided once at start-up.

``device="auto"`` is CUDA when present, else the CPU. ``dtype="auto"`` is bfloat16 on a
GPU, and on a CPU bfloat16 only where the CPU computes it natively (AVX-512 BF16 or AMX
on x86: oneDNN then runs bf16 matmuls at about twice the fp32 rate and every step reads
half the bytes), float32 otherwise (emulated bf16 is slower than fp32).
"""

from __future__ import annotations

import functools

import torch

from radixserve.errors import ConfigurationError
from radixserve.kernels.cpu.native import cpu_flags

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when present, else the CPU. A device asked for by name that this
    process cannot see is refused at start, naming what is missing (no silent CPU
    fallback: ``RADIXSERVE_DEVICE=cpu`` or ``auto`` is the way to run on the CPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        why = ("this torch build has no CUDA (torch " + torch.__version__ + ")"
               if torch.version.cuda is None
               else "no CUDA device is visible (torch.cuda.device_count() == 0)")  # fmt: skip
        raise ConfigurationError(
            f"device {name!r} asked for (RADIXSERVE_DEVICE / --device) but {why}: pass a GPU "
            "to this process (the NVIDIA container toolkit, --gpus) or set "
            "RADIXSERVE_DEVICE=cpu (or auto) to run on the CPU"
        )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 instructions (from the kernel's CPU flags; False
    where they cannot be read, e.g. not Linux)."""
    return bool(_NATIVE_BF16_FLAGS & set(cpu_flags().partition(":")[2].split()))
