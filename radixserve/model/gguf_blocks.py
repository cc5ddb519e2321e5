"""GGUF's Q4_0, Q4_1 and Q8_0 blocks read straight into `QuantizedRows`, without a float
copy of the tensor.

A row of K weights is K/32 blocks. Q4_0: f16 d, 16 bytes of nibbles, ``w = (q - 8) d``.
Q4_1: f16 d, f16 m, 16 bytes, ``w = q d + m``. Byte j of a 4-bit block holds element j
in its low nibble and element j + 16 in its high one. Q8_0: f16 d, 32 int8,
``w = q d``. Q4_x become int4 exactly (zero = m + 8 d); Q8_0's per-block scales become
one scale per row (the int8 kernel's), requantized in chunks of rows.
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.model.quant import GROUP, QuantizedRows, RequantError, dequantize, quantize

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_CHUNK_ROWS = 4096  # Q8_0 rows requantized at a time (bounds the float transient)


def _blocks(data: np.ndarray, kind: str, k: int) -> np.ndarray:
    """(N, K/32, block bytes) view of a tensor's raw rows."""
    return data.reshape(data.shape[0], k // GROUP, _BLOCK_BYTES[kind])


def _f16(raw: np.ndarray) -> torch.Tensor:
    """Little-endian f16 from a (..., 2) byte array, as float32."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def read_q4(data: np.ndarray, kind: str, k: int) -> QuantizedRows:
    """A Q4_0 or Q4_1 tensor's rows as int4, exactly."""
    b = _blocks(data, kind, k)
    n = b.shape[0]
    d = _f16(b[..., 0:2])  # (N, K/32)
    offset = 4 if kind == "Q4_1" else 2
    qs = torch.from_numpy(np.ascontiguousarray(b[..., offset : offset + 16]))  # (N, K/32, 16)
    q = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(n, k)  # elements j, then j + 16
    zero = _f16(b[..., 2:4]) + 8 * d if kind == "Q4_1" else torch.zeros_like(d)
    return QuantizedRows("int4", q, d, zero)


def read_q8_0(data: np.ndarray, k: int, errors: RequantError) -> QuantizedRows:
    """A Q8_0 tensor's rows as int8 with one scale per row (the added error counted)."""
    b = _blocks(data, "Q8_0", k)
    parts, err, ref = [], 0.0, 0.0
    for start in range(0, b.shape[0], _CHUNK_ROWS):
        chunk = b[start : start + _CHUNK_ROWS]
        d = _f16(chunk[..., 0:2])  # (n, K/32)
        qs = torch.from_numpy(np.ascontiguousarray(chunk[..., 2:]).view(np.int8))
        w = (qs.float() * d.unsqueeze(-1)).reshape(chunk.shape[0], k)
        rows = quantize(w, "int8")
        err += float((dequantize(rows) - w).pow(2).sum())
        ref += float(w.pow(2).sum())
        parts.append(rows)
    errors.add_sums("Q8_0→int8 per row", err, ref)
    return QuantizedRows(
        "int8", torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts])
    )


def read_direct(data: np.ndarray, kind: str, k: int, errors: RequantError) -> QuantizedRows:
    if kind == "Q8_0":
        return read_q8_0(data, k, errors)
    return read_q4(data, kind, k)
