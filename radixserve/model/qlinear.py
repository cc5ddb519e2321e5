"""Linear layers over a weight stored in one quantization scheme (`radixserve.model.quant`).

Every layer computes ``y = x @ W.T (+ bias)`` for x (T, K) and loads its weight piece by
piece (the q, k and v rows of a fused qkv arrive one at a time), and `rows(ids)` gives
dequantized rows for an embedding lookup.

- `DenseLinear`: W in the compute dtype (scheme ``none``).
- `Int4Linear`, `Int8Linear`: PyTorch's CPU weight-only kernels
  (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``), which read the packed
  weight once per call and dequantize in registers. They run in bfloat16 whatever the
  compute dtype. Their cost grows with the rows of x about as fast as a dense float32
  matmul's, while oneDNN's bfloat16 matmul (AMX where present) barely grows, so above
  `kernel_rows` rows (measured here) a layer dequantizes its weight into a transient
  dense matrix and runs the dense matmul instead (prefill chunks); decode steps stay on
  the kernel. int4 dequantizes with a small C routine (`radixserve.model.native`: why the
  crossover is 16 rows with or without it).
- `Fp8Linear`: e4m3 weight with per-row scales, activations quantized per row on the
  fly, ``torch._scaled_mm`` (FP8 tensor cores on GPUs that have them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.native import native_dequant
from radixserve.model.quant import (
    FP8_MAX,
    GROUP,
    ROW_BLOCK,
    QuantizedRows,
    Scheme,
    dequantize,
    int4_pack_block,
)

_KERNEL_DTYPE = torch.bfloat16


@functools.cache
def _bf16_gemm() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16, AMX). Without it a
    bfloat16 matmul is emulated: ~100x slower than float32 here, and not exact either."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


class Linear(nn.Module):
    """Base: an (out_features, in_features) weight, loaded by row ranges."""

    scheme: Scheme = "none"

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype

    def load(self, start: int, weight: torch.Tensor | QuantizedRows) -> None:
        """Rows [start, start + len(weight)) of the weight: a float tensor or
        QuantizedRows of this layer's scheme."""
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in the compute dtype (embedding lookup)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.parameters(), *self.buffers()))

    def _float(self, weight: torch.Tensor | QuantizedRows) -> torch.Tensor:
        return dequantize(weight) if isinstance(weight, QuantizedRows) else weight

    def _rows_of(self, weight: QuantizedRows | torch.Tensor) -> QuantizedRows:
        if not isinstance(weight, QuantizedRows) or weight.scheme != self.scheme:
            raise TypeError(f"a {self.scheme} layer loads {self.scheme} rows, not {weight!r}")
        return weight


class DenseLinear(Linear):
    def __init__(
        self, out_features: int, in_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(out_features, in_features, dtype)
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device),
            requires_grad=False,
        )  # uninitialised: load_weights checks that every row is written

    def load(self, start: int, weight: torch.Tensor | QuantizedRows) -> None:
        w = self._float(weight)
        self.weight[start : start + w.shape[0]].copy_(w)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class _KernelLinear(Linear):
    """Shared dispatch: the packed kernel for few rows, dequantize + dense for many."""

    kernel_rows = 32  # rows of x up to which the kernel beats dequantize + dense here

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xb = x.to(_KERNEL_DTYPE)
        if x.shape[0] > self.kernel_rows and _bf16_gemm():  # [x, x] @ [hi; lo].T
            y = F.linear(torch.cat((xb, xb), dim=1), self.dense_pair())
        elif x.shape[0] > self.kernel_rows:  # the same products in float32
            y = F.linear(xb.float(), self._float32())
        else:
            y = self._kernel(xb)
        y = y.to(x.dtype)
        return y if bias is None else y + bias

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense_pair(self) -> torch.Tensor:
        """(N, 2K) bfloat16 [hi | lo] with hi + lo = W to within 2^-16: the dense path
        multiplies by the weight the kernel dequantizes in float32, not a bfloat16-rounded
        one, so both paths give a token the same logits to float32 rounding."""
        return _split(self._float32())

    def _float32(self) -> torch.Tensor:
        """The whole (N, K) weight in float32, with torch ops (transient)."""
        raise NotImplementedError


class _RowScaled(Linear):
    """Codes ``q`` (N, K) and one scale per row (int8, fp8), loaded row range by range."""

    q: torch.Tensor  # (N, K) int8 or float8_e4m3fn
    scale: torch.Tensor  # (N,) for int8, (1, N) for fp8 (torch._scaled_mm's shape)

    def load(self, start: int, weight: torch.Tensor | QuantizedRows) -> None:
        r = self._rows_of(weight)
        end = start + r.shape[0]
        self.q[start:end].copy_(r.q)
        self.scale.view(-1)[start:end].copy_(r.scale)


class Int8Linear(_KernelLinear, _RowScaled):
    scheme: Scheme = "int8"

    def __init__(
        self, out_features: int, in_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(out_features, in_features, dtype)
        self.register_buffer("q", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(out_features, dtype=_KERNEL_DTYPE))

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.q).to(self.dtype) * self.scale[ids].to(self.dtype)[:, None]

    def _float32(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]


class Int4Linear(_KernelLinear):
    """Packed as the CPU kernel wants: (N, K/2) bytes, each block of B rows (64 where
    PyTorch packs for AVX-512, 32 for AVX2: `int4_pack_block`) stored as (K, B/2) bytes
    whose low nibble is row j and high nibble row j + B/2; scales and zeros as
    (K/GROUP, N, 2)."""

    scheme: Scheme = "int4"
    # the native dequantizer's crossover (torch ops alone would have it at 96), kept
    # without it too: which path a prefill takes must not depend on the machine
    kernel_rows = 16
    packed: torch.Tensor  # (N, K/2) uint8
    scales_zeros: torch.Tensor  # (K/group, N, 2)

    def __init__(
        self,
        out_features: int,
        in_features: int,
        dtype: torch.dtype,
        device: torch.device,
        group: int = GROUP,
    ) -> None:
        super().__init__(out_features, in_features, dtype)
        n, k = out_features, in_features
        self.group = group
        self._block = int4_pack_block()  # the packed layout's rows per block, this machine's
        self._native = native_dequant()
        self.register_buffer("packed", torch.empty(n, k // 2, dtype=torch.uint8))
        self.register_buffer("scales_zeros", torch.empty(k // group, n, 2, dtype=_KERNEL_DTYPE))

    def load(self, start: int, weight: torch.Tensor | QuantizedRows) -> None:
        r = self._rows_of(weight)
        assert r.zero is not None and start % ROW_BLOCK == 0 and r.group == self.group
        end = start + r.shape[0]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(r.q.to(torch.int32), 1)
        self.packed[start:end].copy_(packed)
        self.scales_zeros[:, start:end, 0].copy_(r.scale.t())
        self.scales_zeros[:, start:end, 1].copy_(r.zero.t())

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group, self.scales_zeros
        )

    def dense_pair(self) -> torch.Tensor:
        """As the base's, in the native routine's layout: a (N, 2K) view of (2K, N), so
        that the dense matmul is the same call, and sums the same, with or without it."""
        n, k = self.out_features, self.in_features
        if self._native is not None:
            return self._native(self.packed, self.scales_zeros, n, k, self.group).t()
        return _split(self._float32().t(), dim=0).t()  # (N, 2K) view of (2K, N)

    def _float32(self) -> torch.Tensor:
        """(N, K) view of a (K, N) float32 matrix, with torch ops: unpacking along K keeps
        the packed layout's 32-byte runs, and a group's scales broadcast along its rows."""
        n, k = self.out_features, self.in_features
        block = self._block
        b = self.packed.view(n // block, k, block // 2)
        wt = torch.empty(k, n // block, 2, block // 2)
        wt[:, :, 0].copy_((b & 15).transpose(0, 1))  # rows j of each block
        wt[:, :, 1].copy_((b >> 4).transpose(0, 1))  # rows j + block / 2
        scale = self.scales_zeros[..., 0].float()  # (K/G, N)
        zero = self.scales_zeros[..., 1].float()
        grouped = wt.view(k // self.group, self.group, n)
        grouped.sub_(8).mul_(scale[:, None]).add_(zero[:, None])
        return wt.view(k, n).t()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("int4 weights do not serve embedding lookups (plan_schemes uses int8)")


class Fp8Linear(_RowScaled):
    scheme: Scheme = "fp8"

    def __init__(
        self, out_features: int, in_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(out_features, in_features, dtype)
        n, k = out_features, in_features
        self.register_buffer("q", torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("scale", torch.empty(1, n, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        amax = x.abs().amax(-1, keepdim=True).float().clamp_(min=1e-12)  # (T, 1)
        x_scale = amax / FP8_MAX
        xq = (x.float() / x_scale).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(
            xq, self.q.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=torch.bfloat16
        )
        out = out.to(x.dtype)
        return out if bias is None else out + bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].to(self.dtype) * self.scale[0, ids].to(self.dtype)[:, None]


def _split(w: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """float32 w → bfloat16 [hi, lo] joined along ``dim`` ((N, K) → (N, 2K) by default),
    hi = bf16(w), lo = bf16(w - hi): the native routine's numbers, bit for bit (both round
    to nearest even, and w - hi is exact)."""
    hi = w.to(torch.bfloat16)
    return torch.cat((hi, (w - hi.float()).to(torch.bfloat16)), dim=dim)


_LAYERS: dict[str, Callable[[int, int, torch.dtype, torch.device], Linear]] = {
    "none": DenseLinear,
    "int8": Int8Linear,
    "int4": Int4Linear,
    "fp8": Fp8Linear,
}


def make_linear(
    scheme: Scheme, out_features: int, in_features: int, dtype: torch.dtype, device: torch.device
) -> Linear:
    return _LAYERS[scheme](out_features, in_features, dtype, device)
