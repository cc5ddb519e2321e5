"""Weight quantization schemes: what each stores, how to quantize to it, which to use.

A 2-D weight (N output rows, K inputs) is stored by one scheme:

- ``none``: the compute dtype, as before.
- ``int4``: 4-bit codes q in [0, 15] in groups of `GROUP` inputs along K, each group with
  a scale and a zero: ``w = (q - 8) * scale + zero`` (PyTorch's CPU int4 kernel's
  convention). GGUF Q4_0 (``w = (q - 8) d``) and Q4_1 (``w = q d + m``, so
  ``zero = m + 8 d``) map onto it exactly, up to the scale dtype.
- ``int8``: symmetric 8-bit codes with one scale per row: ``w = q * scale``.
- ``fp8``: float8 e4m3 with one scale per row: ``w = q * scale``.

`QuantizedRows` is a weight in one of these forms before the layer packs it for its
kernel (`radixserve.model.qlinear`). `plan_schemes` picks a scheme per model weight from
the ``quantization`` setting and the checkpoint's stored formats.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import torch

from radixserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

Scheme = Literal["none", "int8", "int4", "fp8"]
Quantization = Literal["auto", "none", "int8", "int4", "fp8"]
GROUP = 32  # inputs per int4 group (GGUF's block size)
ROW_BLOCK = 64  # the CPU int4 kernel packs rows in blocks of 64
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# GGUF tensor types kept as int4, and those kept (requantized per row) as int8 by `auto`.
_AUTO_SCHEMES: dict[str | None, Scheme] = {
    "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4",
    "Q8_0": "int8", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8", "Q6_K": "int8", "Q8_K": "int8",
}  # fmt: skip
_NARROW_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K"})  # ≤ 5 bits
DIRECT_TYPES = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}  # read from blocks


@dataclass
class QuantizedRows:
    """A (N, K) weight in one scheme, unpacked: ``q`` (N, K) codes (uint8 0..15 for int4,
    int8, float8_e4m3fn), ``scale`` float32 (N, K/GROUP) for int4 else (N,), ``zero``
    float32 (N, K/GROUP) for int4 else None."""

    scheme: Scheme
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    @property
    def group(self) -> int:
        """Inputs per int4 group."""
        return self.shape[1] // int(self.scale.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def take_rows(self, index: torch.Tensor) -> QuantizedRows:
        """These rows in the order of `index` (a row permutation)."""
        zero = None if self.zero is None else self.zero[index]
        return QuantizedRows(self.scheme, self.q[index], self.scale[index], zero)


def quantize(w: torch.Tensor, scheme: Scheme, group: int = GROUP) -> QuantizedRows:
    """`w` (N, K) float quantized to `scheme` (round to nearest; int4: min/max of each
    `group` inputs)."""
    w = w.float()
    if scheme == "int4":
        n, k = w.shape
        g = w.view(n, k // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15)
        return QuantizedRows("int4", q.view(n, k).to(torch.uint8), scale, lo + 8 * scale)
    amax = w.abs().amax(-1)
    if scheme == "int8":
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        q = torch.round(w / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return QuantizedRows("int8", q, scale)
    if scheme == "fp8":
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return QuantizedRows("fp8", (w / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale)
    raise ValueError(f"cannot quantize to {scheme!r}")


def dequantize(rows: QuantizedRows) -> torch.Tensor:
    """The float32 (N, K) weight `rows` stands for (the reference every kernel matches)."""
    if rows.scheme == "int4":
        assert rows.zero is not None
        n, k = rows.shape
        groups = rows.scale.shape[1]
        q = rows.q.view(n, groups, k // groups).float() - 8
        return (q * rows.scale.unsqueeze(-1) + rows.zero.unsqueeze(-1)).view(n, k)
    return rows.q.float() * rows.scale.unsqueeze(-1)


def int4_fits(n: int, k: int) -> bool:
    """Whether the CPU int4 kernel takes a piece of n rows and k inputs."""
    return n % ROW_BLOCK == 0 and k % GROUP == 0


@dataclass
class RequantError:
    """Error that quantizing at load added, accumulated over tensors and logged once."""

    tensors: int = 0
    sum_sq_err: float = 0.0
    sum_sq: float = 0.0
    worst: float = 0.0
    kinds: set[str] = field(default_factory=set)

    def requantize(self, kind: str, w: torch.Tensor, scheme: Scheme) -> QuantizedRows:
        """`w`, stored as ``kind``, quantized to ``scheme``; the error counted."""
        rows, ref = quantize(w, scheme), w.float()
        err = float((dequantize(rows) - ref).pow(2).sum())
        self.add_sums(f"{kind}→{scheme}", err, float(ref.pow(2).sum()))
        return rows

    def add_sums(self, kind: str, err: float, ref: float) -> None:
        self.sum_sq_err += err
        self.sum_sq += ref
        self.tensors += 1
        self.kinds.add(kind)
        self.worst = max(self.worst, (err / ref) ** 0.5 if ref else 0.0)

    @property
    def relative_rms(self) -> float:
        return (self.sum_sq_err / self.sum_sq) ** 0.5 if self.sum_sq else 0.0

    def log(self, name: str) -> None:
        if self.tensors:
            logger.info(
                "%s: quantized %d tensors at load (%s); added error %.3f%% of the weights' "
                "RMS (worst tensor %.3f%%)",
                name, self.tensors, ", ".join(sorted(self.kinds)),
                100 * self.relative_rms, 100 * self.worst,
            )  # fmt: skip


def _widest(schemes: list[Scheme]) -> Scheme:
    for s in ("none", "int8", "fp8", "int4"):
        if s in schemes:
            return s  # type: ignore[return-value]
    return "none"


def check_quantization(quantization: Quantization, device: torch.device) -> None:
    """Refuse, by name, a scheme this device has no kernel for."""
    if quantization in ("int8", "int4") and device.type != "cpu":
        raise ModelLoadError(
            f"quantization={quantization} uses PyTorch's CPU weight-only kernels; on "
            f"{device.type} use quantization=fp8 or none"
        )
    if quantization == "fp8" and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ModelLoadError(
                f"quantization=fp8 needs a GPU with FP8 (compute capability 8.9+), this one "
                f"is {major}.{minor}"
            )
    if quantization == "fp8" and device.type == "cpu":
        raise ModelLoadError("quantization=fp8 is for GPUs with FP8; on a CPU use int8 or int4")


@dataclass(frozen=True)
class Target:
    """A model weight as the checkpoint stores it: its pieces (name, rows) in row order
    (q, k, v of a fused qkv), and its inputs."""

    pieces: tuple[tuple[str, int], ...]
    inputs: int
    embedding: bool = False


def plan_schemes(
    quantization: Quantization,
    device: torch.device,
    targets: dict[str, Target],
    formats: dict[str, str],
) -> dict[str, Scheme]:
    """The scheme of every (fused) model weight.

    `formats`: checkpoint tensor name → stored format (a GGUF type name such as "Q4_1",
    or a dtype name). ``auto`` keeps a GGUF's quantization where this device has a
    kernel (CPU: Q4_0/Q4_1/Q4_K as int4, Q5/Q6/Q8 types as int8), else ``none``; a fused
    weight takes the widest scheme of its pieces. Embeddings are never int4 (a lookup
    reads whole rows; int8 rows serve both the lookup and a tied LM head), nor is a
    weight whose pieces the int4 kernel cannot take; ``auto`` makes an embedding int8
    only when it is stored in 5 bits or fewer: an 8-bit table (Q8_0) keeps its block
    scales exactly in the compute dtype, where one int8 scale per row would add about
    1 % error to it, and the dense LM head is the faster one here from batch 4 up.
    """
    check_quantization(quantization, device)
    plan: dict[str, Scheme] = {}
    for key, target in targets.items():
        scheme: Scheme = quantization if quantization != "auto" else "none"
        if quantization == "auto" and device.type == "cpu":
            kinds = [formats.get(name) for name, _ in target.pieces]
            scheme = _widest([_AUTO_SCHEMES.get(kind, "none") for kind in kinds])
            if target.embedding and not all(kind in _NARROW_TYPES for kind in kinds):
                scheme = "none"
        if scheme == "int4" and (
            target.embedding or not all(int4_fits(n, target.inputs) for _, n in target.pieces)
        ):
            scheme = "int8"
        plan[key] = scheme
    return plan
