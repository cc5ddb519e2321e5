"""Linear layers over a weight stored in one quantization scheme (`radixserve.model.quant`).

Every layer computes ``y = x @ W.T (+ bias)`` for x (T, K) and loads its weight piece by
piece (the q, k and v rows of a fused qkv arrive one at a time), and `rows(ids)` gives
dequantized rows for an embedding lookup.

- `DenseLinear`: W in the compute dtype (scheme ``none``). `pack_native` gives one (the LM
  head) a second copy in the native GEMM's bfloat16 layout (`pack_bf16`): a decode step's
  head is then one pass over its weight at the memory's rate, each row summed in a fixed
  order whatever the other rows (oneDNN's bfloat16 GEMV took 3-5x longer here).
- `Int4Linear`, `Int8Linear`: the fused quantized GEMM (`radixserve.kernels.cpu.qgemm`, built
  by `radixserve.kernels.cpu.native`) for every number of rows: it unpacks the weight in
  registers, multiplies by the exact weight, and computes each output row the same way
  whatever the other rows, so a token's logits do not depend on batching, chunking or
  the prefix cache. x is rounded to bfloat16 on the way in, as the kernel reads it; the
  output is float32 for a float32 model, else bfloat16.
  Without the C kernel (no compiler, nothing prebuilt, ``RADIXSERVE_NATIVE_KERNELS=0``)
  they run PyTorch's CPU weight-only kernels (``_weight_int4pack_mm_for_cpu``,
  ``_weight_int8pack_mm``) for every number of rows: the same products of the exact
  weight summed in another order, so the same answers' quality but not the same bits.
  Those kernels also sum each row in a fixed order whatever the other rows (measured
  with their AVX-512 and AVX2 code, not promised by PyTorch); their cost grows with the
  rows about as fast as a float32 matmul's, so prefill is slower there.
- `Fp8Linear`: e4m3 weight with per-row scales, activations quantized per row on the
  fly, ``torch._scaled_mm`` (FP8 tensor cores on GPUs that have them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels.cpu.qgemm import (
    BLOCK,
    QGemm,
    native_qgemm,
    pack_bf16,
    pack_int4,
    pack_int8,
    unpack_int8,
    unpack_int8_rows,
)
from radixserve.model.quant import FP8_MAX, GROUP, ROW_BLOCK, QuantizedRows, Scheme, dequantize

_KERNEL_DTYPE = torch.bfloat16


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
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )  # uninitialised: load_weights checks that every row is written
        self._native: tuple[QGemm, torch.Tensor] | None = None  # (kernel, packed W): pack_native

    def load(self, start: int, weight: torch.Tensor | QuantizedRows) -> None:
        w = dequantize(weight) if isinstance(weight, QuantizedRows) else weight
        self.weight[start : start + w.shape[0]].copy_(w)
        self._native = None  # a copy of the old rows

    def pack_native(self) -> int:
        """Keep W in the native GEMM's layout too, where the kernel is built and W is a
        bfloat16 CPU matrix it takes; returns the bytes that copy takes (0: none made)."""
        w = self.weight
        if w.dtype != torch.bfloat16 or w.device.type != "cpu":
            return 0
        if self.out_features % BLOCK or self.in_features % 2:
            return 0
        if (qgemm := native_qgemm()) is None:
            return 0
        packed = pack_bf16(w.detach()).contiguous()
        self._native = (qgemm, packed)
        return packed.nbytes

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._native is not None and x.dtype == torch.bfloat16 and x.is_cpu and bias is None:
            qgemm, packed = self._native
            return qgemm.bf16(x.reshape(-1, self.in_features), packed).view(
                *x.shape[:-1], self.out_features
            )
        return F.linear(x, self.weight, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class _KernelLinear(Linear):
    """Shared dispatch: the native GEMM where it is built, else PyTorch's kernel."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__(out_features, in_features, dtype)
        self._qgemm = native_qgemm()

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._qgemm is not None:
            y = self._native(x, torch.float32 if x.dtype == torch.float32 else _KERNEL_DTYPE)
        else:
            y = self._kernel(x.to(_KERNEL_DTYPE))
        y = y.to(x.dtype)
        return y if bias is None else y + bias

    def _native(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
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
    """With the native GEMM the codes are kept packed (`pack_int8`), N padded to a
    multiple of 16 and K to an even number with zero codes; else as PyTorch's kernel
    takes them, (N, K)."""

    scheme: Scheme = "int8"
    packed: torch.Tensor  # (N/16, K/2, 32) int8, with the native GEMM

    def __init__(
        self, out_features: int, in_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(out_features, in_features, dtype)
        n, k = out_features, in_features
        if self._qgemm is not None:
            n_pad, k_pad = -(-n // BLOCK) * BLOCK, k + k % 2
            packed = torch.zeros(n_pad // BLOCK, k_pad // 2, 32, dtype=torch.int8)
            self.register_buffer("packed", packed)
            self.register_buffer("scale", torch.zeros(n_pad, dtype=_KERNEL_DTYPE))
        else:
            self.register_buffer("q", torch.empty(n, k, dtype=torch.int8))
            self.register_buffer("scale", torch.empty(n, dtype=_KERNEL_DTYPE))

    def load(self, start: int, weight: torch.Tensor | QuantizedRows) -> None:
        if self._qgemm is None:
            super().load(start, weight)
            return
        r = self._rows_of(weight)
        end = start + r.shape[0]
        first, last = start // BLOCK, -(-end // BLOCK)  # the blocks these rows touch
        codes = unpack_int8(self.packed[first:last])
        codes[start - first * BLOCK : end - first * BLOCK, : self.in_features] = r.q
        self.packed[first:last] = pack_int8(codes)
        self.scale[start:end] = r.scale

    def _native(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        assert self._qgemm is not None
        if self.in_features % 2:
            x = F.pad(x, (0, 1))  # the padding input's codes are zero
        y = self._qgemm.int8(x, self.packed, self.scale, out_dtype)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features].contiguous()

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self._qgemm is None:
            q = F.embedding(ids, self.q)
        else:
            q = unpack_int8_rows(self.packed, ids)[:, : self.in_features]
        return q.to(self.dtype) * self.scale[ids].to(self.dtype)[:, None]


class Int4Linear(_KernelLinear):
    """Packed for the native GEMM (`pack_int4`: (N/16, K/8, 64) bytes) where it is built,
    else as PyTorch's CPU kernel packs it (``_convert_weight_to_int4pack_for_cpu``: its
    layout depends on the instruction set PyTorch was built for). Scales and zeros as
    (K/GROUP, N, 2) either way."""

    scheme: Scheme = "int4"
    packed: torch.Tensor  # (N/16, K/8, 64) or (N, K/2) uint8
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
        shape = (n // BLOCK, k // 8, 64) if self._qgemm is not None else (n, k // 2)
        self.register_buffer("packed", torch.empty(shape, dtype=torch.uint8))
        self.register_buffer("scales_zeros", torch.empty(k // group, n, 2, dtype=_KERNEL_DTYPE))

    def load(self, start: int, weight: torch.Tensor | QuantizedRows) -> None:
        r = self._rows_of(weight)
        assert r.zero is not None and start % ROW_BLOCK == 0 and r.group == self.group
        end = start + r.shape[0]
        if self._qgemm is not None:
            self.packed[start // BLOCK : end // BLOCK].copy_(pack_int4(r.q))
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(r.q.to(torch.int32), 1)
            self.packed[start:end].copy_(packed)
        self.scales_zeros[:, start:end, 0].copy_(r.scale.t())
        self.scales_zeros[:, start:end, 1].copy_(r.zero.t())

    def _native(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        assert self._qgemm is not None
        return self._qgemm.int4(x, self.packed, self.scales_zeros, self.group, out_dtype)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group, self.scales_zeros
        )

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
