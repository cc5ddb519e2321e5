"""Argument checks run before every launch: a kernel given the wrong shape, stride, dtype
or device fails here with a message naming the argument, not with a fault or silent
garbage on the GPU."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton

# Read once, when the kernels are defined: the same switch makes `triton.jit` build
# interpreted functions (CPU tensors, numpy) instead of compiled GPU kernels.
INTERPRETED: bool = (
    bool(triton.knobs.runtime.interpret)
    if hasattr(triton, "knobs")  # triton >= 3.4
    else os.environ.get("TRITON_INTERPRET", "0") == "1"
)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int64, torch.int32)


def check_tensor(
    op: str,
    name: str,
    t: torch.Tensor,
    shape: Sequence[int | None],
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    last_dim_contiguous: bool = True,
) -> None:
    """`t` has `shape` (None matches any size), one of `dtypes`, unit stride in its last
    dimension, and lives where this process's Triton kernels run."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected {want}")
    if t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}, expected one of {list(dtypes)}")
    if last_dim_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} needs a unit stride in its last dimension")
    check_device(op, name, t)


def check_index(op: str, name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    check_tensor(op, name, t, shape, _INDEX_DTYPES)
    if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{op}: {name} rows must be contiguous")


def check_same_dtype(op: str, **tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"{op}: dtypes differ: {dtypes}")


def check_pages(op: str, name: str, cache: torch.Tensor) -> None:
    """A (num_pages, page_size, H_kv, D) layer cache whose tokens are equally spaced
    (a layer view of the pool is), so slot s starts at element s * H_kv * D."""
    check_tensor(op, name, cache, (None, None, None, None))
    _, page_size, heads, dim = cache.shape
    if cache.stride()[1:] != (heads * dim, dim, 1) or cache.stride(0) != page_size * heads * dim:
        raise ValueError(f"{op}: {name} must be contiguous within the layer, got strides "
                         f"{cache.stride()}")  # fmt: skip


def check_attention(
    op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[int, int]:
    """q (*, H, D) against one layer's caches; returns (page_size, H_kv)."""
    check_tensor(op, "q", q, (None, None, None))
    check_pages(op, "k_cache", k_cache)
    check_pages(op, "v_cache", v_cache)
    heads, dim = q.shape[1:]
    _, page_size, kv_heads, _ = k_cache.shape
    if v_cache.shape != k_cache.shape or k_cache.shape[3] != dim:
        raise ValueError(f"{op}: caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} "
                         f"do not match q's head_dim {dim}")  # fmt: skip
    if heads % kv_heads:
        raise ValueError(f"{op}: {heads} q heads are not a multiple of {kv_heads} kv heads")
    check_same_dtype(op, q=q, k_cache=k_cache, v_cache=v_cache)
    return page_size, kv_heads


def check_device(op: str, name: str, t: torch.Tensor) -> None:
    want = "cpu" if INTERPRETED else "cuda"
    if t.device.type != want:
        where = "CPU tensors (TRITON_INTERPRET=1)" if INTERPRETED else "CUDA tensors"
        raise ValueError(f"{op}: {name} is on {t.device}; these kernels take {where}")


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands must be upcast to float32 first: the interpreter keeps
    bfloat16 as raw uint16 bits and multiplies those integers (triton 3.9: only casts
    from and to bfloat16 are exact there), so interpreted bfloat16 dots run in float32."""
    return INTERPRETED and dtype == torch.bfloat16


def block(n: int, least: int = 1) -> int:
    """The power-of-two block covering n (at least `least`)."""
    return max(least, triton.next_power_of_2(max(n, 1)))


def num_warps(block_elems: int) -> int:
    """Warps for a program that holds `block_elems` values: 4 up to 2048, then more so
    that each thread keeps a few dozen of them in registers."""
    return 16 if block_elems >= 8192 else 8 if block_elems >= 2048 else 4
