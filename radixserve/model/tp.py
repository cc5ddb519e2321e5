"""Tensor parallelism: how one model is split over the ranks of a worker.

A worker of tensor-parallel size N runs the same forward on N ranks, each holding a
slice of every layer (Megatron's split, as vLLM and SGLang do it):

- **column-parallel** q/k/v and gate/up: rank r computes its own query heads, its KV
  heads and its share of the MLP's intermediate rows, with no communication;
- **row-parallel** o and down: each rank multiplies its slice of the inputs, and one
  all-reduce per block half sums the partial outputs (every rank gets the same sum);
- **vocab-parallel** embedding and LM head: rank r holds rows [r V', (r + 1) V') of the
  vocabulary (V' = ceil(V / N); rows past V are zeros); a lookup is summed over ranks
  (one rank contributes each row, the others zeros), and the LM head's slices are
  gathered into the full logits.

A mixture-of-experts layer splits each expert like the dense MLP (its gate/up rows
column-parallel, its down inputs row-parallel; every rank holds every expert) and keeps
the router whole on each rank.

KV heads are split like query heads when the KV heads divide by N. When there are fewer
KV heads than ranks and N divides by them, each KV head is replicated on N / H_kv ranks
(each rank keeps one, the one its query heads read), as vLLM and mini-sglang do. Any
other split is refused at start (`TPShard.check`), naming the model's head counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from radixserve.errors import ModelLoadError
from radixserve.model.config import ModelConfig
from radixserve.model.quant import QuantizedRows

Take = tuple[int, int, int]  # (dim, lo, hi): the slice of a checkpoint tensor a rank keeps


class TPComm(Protocol):
    """The collectives a model shard calls, over its worker's ranks in rank order."""

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place; every rank gets the same sum."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` joined along the last dimension, in rank order."""
        ...


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of a tensor-parallel group of ``size`` ranks (size 1: no split)."""

    rank: int = 0
    size: int = 1

    def check(self, c: ModelConfig) -> None:
        """Raise ModelLoadError, naming the model's head counts, unless ``c`` splits over
        ``size`` ranks."""
        n = self.size
        if n == 1:
            return
        problems = []
        if c.num_heads % n:
            problems.append(f"its {c.num_heads} query heads do not divide by {n}")
        if c.num_kv_heads % n and n % c.num_kv_heads:
            problems.append(
                f"its {c.num_kv_heads} KV heads neither divide by {n} nor divide {n} (a KV "
                "head is replicated only when the ranks are a multiple of the KV heads)"
            )
        if c.intermediate_size % n:
            problems.append(f"its MLP's {c.intermediate_size} rows do not divide by {n}")
        if c.moe_layers and c.moe_intermediate_size % n:
            problems.append(f"its experts' {c.moe_intermediate_size} rows do not divide by {n}")
        if problems:
            raise ModelLoadError(
                f"tensor-parallel size {n} does not fit {c.name} ({c.num_heads} query heads, "
                f"{c.num_kv_heads} KV heads): {'; '.join(problems)}"
            )

    def q_heads(self, c: ModelConfig) -> int:
        return c.num_heads // self.size

    def kv_heads(self, c: ModelConfig) -> int:
        """KV heads this rank holds (1, replicated, when there are fewer than ranks)."""
        return max(1, c.num_kv_heads // self.size)

    def kv_head_start(self, c: ModelConfig) -> int:
        """The model's first KV head this rank holds: the one its query heads read."""
        if c.num_kv_heads >= self.size:
            return self.rank * self.kv_heads(c)
        return self.rank // (self.size // c.num_kv_heads)

    def ff(self, c: ModelConfig) -> int:
        return c.intermediate_size // self.size

    def moe_ff(self, c: ModelConfig) -> int:
        """Each expert's intermediate rows on this rank."""
        return c.moe_intermediate_size // self.size

    def vocab_rows(self, c: ModelConfig) -> int:
        """Rows of the vocabulary each rank holds (the last may hold padding)."""
        return -(-c.vocab_size // self.size)

    def vocab_range(self, c: ModelConfig) -> tuple[int, int]:
        """The real vocabulary rows [lo, hi) of this rank (hi - lo may be short of
        `vocab_rows` on the last ranks)."""
        rows = self.vocab_rows(c)
        lo = min(self.rank * rows, c.vocab_size)
        return lo, min(lo + rows, c.vocab_size)


def take(weight: torch.Tensor | QuantizedRows, how: Take | None, name: str):
    """The slice ``how`` of a checkpoint tensor (rows or inputs), or the whole of it.

    Quantized weights are sliced in their codes: rows freely; inputs (a row-parallel
    weight) at int4 group boundaries, and per-row scales (int8, fp8) are kept whole,
    since a slice of a row has the row's scale."""
    if how is None:
        return weight
    dim, lo, hi = how
    if isinstance(weight, torch.Tensor):
        return weight.narrow(dim, lo, hi - lo)
    zero = weight.zero
    if dim == 0:
        z = None if zero is None else zero[lo:hi]
        return QuantizedRows(weight.scheme, weight.q[lo:hi], weight.scale[lo:hi], z)
    if weight.scheme != "int4":
        return QuantizedRows(weight.scheme, weight.q[:, lo:hi], weight.scale, zero)
    g = weight.group
    if lo % g or hi % g:
        raise ModelLoadError(
            f"{name}: a tensor-parallel rank's inputs [{lo}, {hi}) cut its int4 groups of "
            f"{g}; use another tensor-parallel size or quantization=int8 or none"
        )
    assert zero is not None
    return QuantizedRows("int4", weight.q[:, lo:hi], weight.scale[:, lo // g : hi // g],
                         zero[:, lo // g : hi // g])  # fmt: skip
