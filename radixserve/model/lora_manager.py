"""The adapters an engine serves (`LoraManager`) and one step's rows of them
(`LoraBatch`).

Every loaded adapter keeps its tensors on the host (`radixserve.model.lora.LoraAdapter`);
up to ``max_loras`` of them are *resident*: copied into a slot of the device stacks, one
stack per adapted projection (a checkpoint projection: a layer's q_proj, ..., down_proj)::

    a (max_loras, R, in)   b (max_loras, out, R)   scaling (max_loras,) float32
      slot s: the adapter's A in a[s, :r], B in b[s, :, :r], zeros elsewhere
      R: the largest rank of the loaded adapters (at most max_lora_rank); b is stored
      (max_loras, R, out) and used as its transpose (the kernels' vectors run along out)

The stacks are remade at the new R when an adapter of a larger rank is loaded, or the
largest is unloaded: an adapter of rank r < R computes the same bits at any R >= r (its
zero rows and columns add +0 to sums that start at +0), and a smaller R is fewer
multiply-adds and bytes a step (`tests/model/test_lora_fused.py` checks the bits).

A stack is made when the first adapter targeting its projection becomes resident; an
adapter that does not target it has zeros in its slot (and the step skips a stack none of
its rows' adapters targets). A step whose rows name adapters makes them all resident
first, evicting the least recently used adapters no row of the step names (their host
copies stay: a later step copies them in again). The scheduler admits no more distinct
adapters into the running set than there are slots (`Scheduler.max_adapters`), so a
step always finds room.

`LoraBatch` is a step's row → slot map (-1: the base model) with the stacks; the model's
layers call `add` after each projection (`radixserve.model.llama.DecoderLayer`), which
runs the kernel set's ``lora_apply`` on the projection's columns of each adapted segment.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from radixserve.errors import ModelLoadError, UnknownAdapterError
from radixserve.kernels.ops import KernelOps
from radixserve.model.config import ModelConfig
from radixserve.model.lora import LoraAdapter, Segment, load_adapter, segments

logger = logging.getLogger(__name__)


@dataclass
class _Stack:
    """One adapted projection's slots on the device, and which slots hold an adapter."""

    segment: Segment
    a: torch.Tensor  # (L, R, in)
    b: torch.Tensor  # (L, out, R): a view of a (L, R, out) tensor
    scaling: torch.Tensor  # (L,) float32
    used: set[int] = field(default_factory=set)


class LoraManager:
    """Adapters by name and their device slots (engine thread)."""

    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.dtype, self.device = dtype, device
        self.adapters: dict[str, LoraAdapter] = {}  # every loaded adapter, by name
        self.resident: OrderedDict[str, int] = OrderedDict()  # name → slot, LRU first
        self._segments = segments(config)
        self._stacks: dict[str, _Stack] = {}  # by checkpoint name
        # by (layer, fused weight): ("qkv", "o_proj", "gate_up", "down")
        self._by_weight: dict[tuple[int, str], list[_Stack]] = {}
        self.num_loads = 0  # copies of an adapter into a slot (a measure of LRU churn)
        self.num_evictions = 0  # resident adapters whose slot another took
        # the same two, by adapter name (what `counts` reports)
        self._loads: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter()
        self.rank = 0  # the stacks' R: the largest loaded adapter's rank
        # counts changes to the stacks (made, remade, a slot written or freed): a copy of
        # their pointers or slot map (the native decode step's) is remade when it moves
        self.generation = 0

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and check the adapter at ``path`` and serve it as ``name`` (ModelLoadError
        naming what is wrong; a name in use is refused: unload it first)."""
        if not name or "=" in name:
            raise ModelLoadError(f"adapter name {name!r} must be non-empty and without '='")
        if name in self.adapters:
            raise ModelLoadError(f"an adapter named {name!r} is already loaded; unload it first")
        adapter = load_adapter(name, path, self.config, self.max_rank, self.dtype)
        self.adapters[name] = adapter
        self._fit_rank()
        logger.info("LoRA adapter %s loaded from %s: r=%d on %s (%.1f MiB, %s)", name, path,
                    adapter.rank, ",".join(adapter.targets), adapter.size_bytes / (1 << 20),
                    adapter.fingerprint[:19])  # fmt: skip
        return adapter

    def unload(self, name: str) -> None:
        """Stop serving ``name`` (its slot freed); the caller checks no request uses it."""
        self.adapter(name)
        del self.adapters[name]
        slot = self.resident.pop(name, None)
        if slot is not None:
            for stack in self._stacks.values():
                stack.used.discard(slot)
            self.generation += 1
        self._fit_rank()

    def adapter(self, name: str) -> LoraAdapter:
        """The adapter loaded as ``name``; UnknownAdapterError naming it otherwise."""
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise UnknownAdapterError(f"no LoRA adapter {name!r} is loaded (loaded: {known})",
                                      param="model")  # fmt: skip
        return adapter

    def batch(self, runs: Sequence[tuple[str, int]]) -> LoraBatch | None:
        """A step's rows, given as runs (adapter name or "" for the base model, rows) in
        row order: None when no row has an adapter, else its `LoraBatch` (the adapters
        made resident)."""
        names = {name for name, _ in runs if name}
        if not names:
            return None
        slot_of = self._make_resident(names)
        slots = [slot_of[name] if name else -1 for name, _ in runs]
        counts = [n for _, n in runs]
        row_slot = torch.repeat_interleave(torch.tensor(slots), torch.tensor(counts))  # (T,)
        return LoraBatch(row_slot.to(self.device), set(slot_of.values()), self._by_weight,
                         self.generation)  # fmt: skip

    def _make_resident(self, names: set[str]) -> dict[str, int]:
        """Slots holding ``names``, copying in those that are not resident (each into a
        free slot, else the least recently used one of an adapter not in ``names``)."""
        for name in sorted(names, key=lambda n: n not in self.resident):
            if name in self.resident:
                self.resident.move_to_end(name)
                continue
            free = set(range(self.max_loras)) - set(self.resident.values())
            if free:
                slot = min(free)
            else:
                victim = next((n for n in self.resident if n not in names), None)
                if victim is None:  # the scheduler keeps a step's adapters within the slots
                    raise RuntimeError(f"a step names more adapters than {self.max_loras} slots")
                slot = self.resident.pop(victim)
                self.num_evictions += 1
                self._evictions[victim] += 1
            self._write(self.adapter(name), slot)
            self._loads[name] += 1
            self.resident[name] = slot
        return {name: self.resident[name] for name in names}

    def counts(self) -> dict[str, tuple[int, int]]:
        """Each loaded adapter's copies into a slot and evictions from one, by name."""
        return {name: (self._loads[name], self._evictions[name]) for name in self.adapters}

    @torch.no_grad()
    def _write(self, adapter: LoraAdapter, slot: int) -> None:
        """Copy ``adapter`` into ``slot`` of every stack (zeros where it adapts nothing)."""
        for base in adapter.weights:
            if base not in self._stacks:
                self._stacks[base] = self._new_stack(self._segments[base])
        for base, stack in self._stacks.items():
            stack.a[slot].zero_()
            stack.b[slot].zero_()
            stack.scaling[slot] = 0.0
            stack.used.discard(slot)
            if base in adapter.weights:
                a, b = adapter.weights[base]
                stack.a[slot, : adapter.rank].copy_(a)
                stack.b[slot, :, : adapter.rank].copy_(b)
                stack.scaling[slot] = adapter.scaling
                stack.used.add(slot)
        self.num_loads += 1
        self.generation += 1

    def _fit_rank(self) -> None:
        """Remake the stacks at R = the largest loaded adapter's rank, if it changed (the
        resident adapters' tensors copied over: their zeros past their own rank aside,
        the stacks hold the same numbers)."""
        rank = max((a.rank for a in self.adapters.values()), default=0)
        if rank == self.rank:
            return
        keep = min(rank, self.rank)
        self.rank = rank
        for stack in self._stacks.values():
            a, b = self._zeros(stack.segment)
            a[:, :keep].copy_(stack.a[:, :keep])
            b[:, :, :keep].copy_(stack.b[:, :, :keep])
            stack.a, stack.b = a, b
        self.generation += 1

    def _zeros(self, seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """A projection's A and B stacks at the current rank, zeros: a (L, R, in) and b
        (L, out, R), a view of (L, R, out) storage."""
        n, r, dtype, device = self.max_loras, self.rank, self.dtype, self.device
        a = torch.zeros(n, r, seg.in_features, dtype=dtype, device=device)  # (L, R, in)
        b = torch.zeros(n, r, seg.width, dtype=dtype, device=device)  # (L, R, out)
        return a, b.transpose(1, 2)

    def _new_stack(self, seg: Segment) -> _Stack:
        a, b = self._zeros(seg)
        stack = _Stack(seg, a, b, torch.zeros(self.max_loras, dtype=torch.float32,
                                              device=self.device))  # fmt: skip
        self.generation += 1
        weight = seg.key.split(".")[-1]
        group = self._by_weight.setdefault((seg.layer, weight), [])
        group.append(stack)
        group.sort(key=lambda s: s.segment.start)
        return stack


@dataclass(frozen=True)
class LoraBatch:
    """One step's rows of adapters: ``row_slot`` (T,) int64, each row's slot (-1: the
    base model); ``slots``, those the step uses; the stacks by (layer, fused weight);
    the manager's ``generation`` (which the stacks' pointers and slots are)."""

    row_slot: torch.Tensor
    slots: set[int]
    stacks: dict[tuple[int, str], list[_Stack]]
    generation: int

    def add(
        self, ops: KernelOps, layer: int, weight: str, x: torch.Tensor, y: torch.Tensor
    ) -> None:
        """y += each row's adapter update of the fused projection ``weight`` ("qkv",
        "o_proj", "gate_up", "down") of ``layer``, whose input is x (T, in) and output
        y (T, out), in place: each adapted segment's columns of y."""
        for stack in self.stacks.get((layer, weight), ()):
            if stack.used.isdisjoint(self.slots):
                continue  # none of this step's adapters adapts it
            seg = stack.segment
            out = y[:, seg.start : seg.start + seg.width]  # (T, width): a column view
            ops.lora_apply(x, out, stack.a, stack.b, self.row_slot, stack.scaling)
