"""The batched LoRA matmul for multi-LoRA serving: each row of a batch adds its own
adapter's low-rank update to a projection's output, or nothing (the base model).

The sums are written out in a fixed order, the one the native CPU kernel (`cpu/lora.c`)
and the Triton kernel (`triton/lora.py`) follow, so that every set computes exactly these
bits, and a row's bits never depend on the other rows. Every dot product of length n
here (`fixed_dot`) is:

    lane[j] = 0 for j in 0..15
    for each chunk c = 0, 1, ... of 16 consecutive terms in order:
        lane[j] = lane[j] + p[16 c + j]          (p: the float32 products, rounded;
                                                  0 past the end)
    halve 16 -> 8 -> 4 -> 2 -> 1: lane[j] = lane[j] + lane[j + half]
    the dot is lane[0]

Layouts: x (N, K), y (N, M), a (L, R, K), b (L, M, R), row_slot (N,), scaling (L,).
This is the specification, not a fast path: a Python loop over the chunks (a prefill
chunk of 256 rows is ~0.1 s a projection).
"""

from __future__ import annotations

import torch

LANES = 16  # partial sums per dot product, added pairwise at the end
_CHUNK_ELEMENTS = 1 << 22  # float32 products held at once (16 MiB)


def lora_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slot: torch.Tensor,
    scaling: torch.Tensor,
) -> None:
    """y[i] += scaling[s] * (b[s] @ (a[s] @ x[i])) for each row i with s = row_slot[i] >= 0;
    rows with row_slot -1 (the base model) are left alone. In place on y.
    x (N, K) bfloat16 or float32; y (N, M) same dtype, may be a non-contiguous column slice
    view of a wider output (stride(1) == 1); a (L, R, K) and b (L, M, R) the stacked
    adapters' A and B (same dtype as x; an adapter of rank r < R is zero-padded);
    row_slot (N,) int64; scaling (L,) float32 (lora_alpha / r, per slot).
    Arithmetic (the same in every set, fixed per row whatever the other rows):
    t = float32(a[s]) @ float32(x[i]) accumulated in float32, rounded to x's dtype;
    y[i] = round(float32(y[i]) + scaling[s] * (float32(b[s]) @ float32(t))).
    Each float32 dot product sums its products in the fixed order of `fixed_dot` (16
    lanes, then a pairwise halving); the product scaling[s] * (b[s] @ t) is rounded to
    float32 before it is added to y."""
    check_lora_args(x, y, a, b, row_slot, scaling)
    for slot in torch.unique(row_slot).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(row_slot == slot).flatten()
        a32, b32 = a[slot].float(), b[slot].float()  # (R, K), (M, R)
        per_chunk = max(1, _CHUNK_ELEMENTS // (a32.numel() + b32.numel()))
        for start in range(0, rows.numel(), per_chunk):
            chunk = rows[start : start + per_chunk]
            t = fixed_dot(a32, x[chunk].float()[:, None, :])  # (n, R)
            t = t.to(x.dtype).float()
            delta = scaling[slot].float() * fixed_dot(b32, t[:, None, :])  # (n, M)
            y[chunk] = (y[chunk].float() + delta).to(y.dtype)


def fixed_dot(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """w (J, n) and v (..., 1, n) float32 → (..., J): each w[j] · v in the order above."""
    p = w * v  # (..., J, n) the products, each rounded to float32
    n = p.shape[-1]
    p = torch.nn.functional.pad(p, (0, -n % LANES)).unflatten(-1, (-1, LANES))  # (..., J, C, 16)
    lanes = p.new_zeros(p.shape[:-2] + (LANES,))
    for c in range(p.shape[-2]):
        lanes = lanes + p[..., c, :]
    half = LANES // 2
    while half >= 1:
        lanes = lanes[..., :half] + lanes[..., half : 2 * half]
        half //= 2
    return lanes[..., 0]


def check_lora_args(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slot: torch.Tensor,
    scaling: torch.Tensor,
) -> None:
    """Raise ValueError unless the shapes, dtypes and slots are the op's (a kernel reads
    a[s] and b[s] of every row's slot s, so an s past the stack must never reach one).
    Reads row_slot's values: a host sync where they live on a device."""
    if x.dim() != 2 or y.dim() != 2 or a.dim() != 3 or b.dim() != 3:
        raise ValueError("lora_apply takes x (N, K), y (N, M), a (L, R, K) and b (L, M, R)")
    (n, k), m, (num_slots, rank) = x.shape, y.shape[1], a.shape[:2]
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"lora_apply takes bfloat16 or float32 x, not {x.dtype}")
    if not (y.dtype == a.dtype == b.dtype == x.dtype):
        raise ValueError(
            f"lora_apply needs x, y, a and b of one dtype, not {x.dtype}, {y.dtype}, "
            f"{a.dtype}, {b.dtype}"
        )
    if y.shape[0] != n or a.shape != (num_slots, rank, k) or b.shape != (num_slots, m, rank):
        raise ValueError(
            f"lora_apply shapes: x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)} "
            f"(L, R, K), b {tuple(b.shape)} (L, M, R)"
        )
    if row_slot.shape != (n,) or row_slot.dtype != torch.int64:
        raise ValueError(f"lora_apply row_slot must be ({n},) int64")
    if scaling.shape != (num_slots,) or scaling.dtype != torch.float32:
        raise ValueError(f"lora_apply scaling must be ({num_slots},) float32")
    if n and (int(row_slot.min()) < -1 or int(row_slot.max()) >= num_slots):
        raise ValueError(f"lora_apply row_slot values must be in [-1, {num_slots})")
