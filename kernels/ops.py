"""The op table and the choice of kernel set, made once per process.

A kernel set ("torch": `reference/` with the CPU paths of `cpu/`, "triton": `triton/`) is
a `KernelOps` whose fields share one signature per op across sets. Sets are registered by
name and imported only when asked for, so a process that runs the torch set never imports
triton.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# name -> the module whose `OPS` is that set's KernelOps
_SETS = {"torch": "radixserve.kernels.cpu", "triton": "radixserve.kernels.triton"}
BACKEND_NAMES: tuple[str, ...] = tuple(_SETS)


@dataclass(frozen=True)
class KernelOps:
    """One implementation of every op the model and the transfers use."""

    name: str
    store_kv: Callable[..., None]
    extend_attention: Callable[..., Any]
    decode_attention: Callable[..., Any]
    pack_pages: Callable[..., Any]
    unpack_pages: Callable[..., None]
    rmsnorm: Callable[..., Any]
    rope: Callable[..., None]
    silu_and_mul: Callable[..., Any]
    fused_moe: Callable[..., Any]  # a mixture-of-experts MLP over routed tokens
    lora_apply: Callable[..., None]  # each row's adapter update, in place (multi-LoRA)


def load_ops(name: str) -> KernelOps:
    """The kernel set registered as `name`, imported now if it was not yet."""
    if name not in _SETS:
        raise ValueError(f"unknown kernel backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    return importlib.import_module(_SETS[name]).OPS


def triton_interpreted() -> bool:
    """Whether the Triton kernels run in the CPU interpreter: decided when they are first
    imported, by TRITON_INTERPRET=1 in the environment then."""
    module = sys.modules.get(_SETS["triton"])
    if module is not None:
        return bool(module.INTERPRETED)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(requested: str, device_type: str) -> str:
    """The kernel set for a device: `requested`, or for "auto" triton where the device
    is CUDA and triton imports, torch otherwise. Raises ValueError for a set that
    cannot run there (triton on CPU outside the interpreter)."""
    if requested == "auto":
        return "triton" if device_type == "cuda" and _triton_importable() else "torch"
    if requested not in _SETS:
        raise ValueError(
            f"unknown kernel backend {requested!r}; known: auto, {', '.join(BACKEND_NAMES)}"
        )
    if requested == "triton":
        if not _triton_importable():
            raise ValueError("attention_backend 'triton' needs the triton package installed")
        if device_type != "cuda" and not triton_interpreted():
            raise ValueError(
                "attention_backend 'triton' runs on CUDA devices; on CPU only under the "
                "Triton interpreter (TRITON_INTERPRET=1 set before start), which is for tests"
            )
    return requested


def _triton_importable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        importlib.import_module("triton")
    except Exception:  # a broken install (no driver libraries, ...) means no triton
        return False
    return True
