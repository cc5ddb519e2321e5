"""A cached turn's compute floor: its delta's FLOPs at the rates this machine's layer
matrices and native attention reach, measured in the calling process.

A delta of R new tokens over a P-token prefix in the pages (context P + R) costs

    GEMM FLOPs       2 × R × the layer matrices' parameters (qkv, o, gate_up, down; every
                     layer) + 2 × vocab × hidden (the LM head, for the last row only)
    attention FLOPs  R × (P + (R + 1) / 2) × heads × head_dim × 4 × layers
                     (a row reads the prefix and the delta's rows up to its own: QKᵀ and PV)

and its floor is the GEMM FLOPs at the layer matrices' rate on R rows plus the attention
FLOPs at the native attention's rate on R rows over that prefix (`Rates`, measured on
layer 0 by `measure_rates`: the medians of 20 calls each). The rates of isolated calls,
each with its own thread hand-off, are what the machine gives one op alone, not a bound
on a fused step: a step may come in under its floor (`bench/extend_ab.py`).

Used by `bench/extend_ab.py` (one step's delta against its floor) and by
`--scenario peer` (radixserve's cached turns against theirs, `peer_report`).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixserve.kernels.cpu.attention import extend_attention
from radixserve.model.forward_batch import ForwardBatch, SequenceChunk, build_forward_batch

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine

PREFILL_CHUNK = 512  # prefix tokens per forward while filling the pages


def median_ms(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@dataclass(frozen=True)
class FloorShape:
    """What a delta's FLOPs depend on."""

    layer_params: int  # the layer matrices' parameters, every layer
    vocab_size: int
    hidden_size: int
    num_heads: int
    head_dim: int
    num_layers: int

    @classmethod
    def of(cls, engine: Engine) -> FloorShape:
        c, layer = engine.config, engine.model.decoder_layers[0]
        return cls(layer_params(engine), c.vocab_size, c.hidden_size, layer.num_heads,
                   layer.head_dim, c.num_layers)  # fmt: skip

    def gemm_flops(self, rows: int) -> float:
        return 2 * rows * self.layer_params + 2 * self.vocab_size * self.hidden_size

    def attention_flops(self, rows: int, prefix_len: int) -> float:
        mean_keys = prefix_len + (rows + 1) / 2  # the keys a row reads, on average
        return rows * mean_keys * self.num_heads * self.head_dim * 4 * self.num_layers


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise linear through (xs, ys), xs ascending; the end values outside them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_left(xs, x)
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


@dataclass(frozen=True)
class Rates:
    """GFLOP/s measured at a few row counts (and prefix lengths, for the attention);
    between them interpolated (linearly in log rows and in prefix length), outside
    them the nearest measured value."""

    rows: tuple[int, ...]  # ascending
    gemm_gflops: tuple[float, ...]  # per rows
    prefix_lens: tuple[int, ...]  # ascending
    attention_gflops: tuple[tuple[float, ...], ...]  # [prefix][rows]

    def gemm(self, rows: float) -> float:
        return _interp(math.log2(rows), [math.log2(r) for r in self.rows], self.gemm_gflops)

    def attention(self, rows: float, prefix_len: float) -> float:
        log_rows = [math.log2(r) for r in self.rows]
        per_prefix = [_interp(math.log2(rows), log_rows, ys) for ys in self.attention_gflops]
        return _interp(prefix_len, self.prefix_lens, per_prefix)

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": list(self.rows),
            "gemm_gflops": list(self.gemm_gflops),
            "prefix_lens": list(self.prefix_lens),
            "attention_gflops": [list(a) for a in self.attention_gflops],
        }


@dataclass(frozen=True)
class ComputeFloor:
    shape: FloorShape
    rates: Rates

    def floor_ms(self, rows: int, prefix_len: int) -> float:
        """A delta of ``rows`` new tokens over ``prefix_len`` cached ones, at the rates."""
        rates = self.rates.gemm(rows), self.rates.attention(rows, prefix_len)
        return floor_ms(self.shape, rows, prefix_len, *rates)


def floor_ms(
    shape: FloorShape, rows: int, prefix_len: int, gemm_rate: float, attention_rate: float
) -> float:
    """The delta's GEMM FLOPs at ``gemm_rate`` plus its attention FLOPs at
    ``attention_rate`` (GFLOP/s), in ms."""
    gemm_ms = shape.gemm_flops(rows) / gemm_rate / 1e6
    return gemm_ms + shape.attention_flops(rows, prefix_len) / attention_rate / 1e6


def layer_params(engine: Engine) -> int:
    return sum(
        p.in_features * p.out_features
        for layer in engine.model.decoder_layers
        for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    )


def gemm_gflops(engine: Engine, rows: int) -> float:
    """The layer matrices' rate on `rows` rows (layer 0's four, as the torch path calls them)."""
    layer = engine.model.decoder_layers[0]
    flops, ms = 0, 0.0
    for proj in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
        x = torch.randn(rows, proj.in_features).to(engine.dtype)  # (R, K)
        proj(x)
        ms += median_ms(functools.partial(proj, x), 20)
        flops += 2 * rows * proj.in_features * proj.out_features
    return flops / ms / 1e6


def attention_gflops(engine: Engine, fb: ForwardBatch) -> float:
    """The native attention's rate on one sequence's delta rows over its prefix (layer
    0's pool)."""
    layer, meta = engine.model.decoder_layers[0], fb.attn
    rows, (k, v) = fb.input_ids.shape[0], engine.kv_pool.layers[0]
    assert meta.prefix_lens.numel() == 1, "one sequence"
    mean_keys = int(meta.prefix_lens[0]) + (rows + 1) / 2
    q = torch.randn(rows, layer.num_heads, layer.head_dim).to(engine.dtype)  # (R, H, D)
    call = lambda: extend_attention(q, k, v, meta.cu_seqlens_q, meta.prefix_lens,  # noqa: E731
                                    meta.page_table, meta.max_query_len)  # fmt: skip
    call()
    ms = median_ms(call, 20)
    return rows * mean_keys * layer.num_heads * layer.head_dim * 4 / ms / 1e6


def delta_batch(engine: Engine, pages: list[int], prefix_len: int, rows: int) -> ForwardBatch:
    """One step of ``rows`` new tokens (random ids) after ``prefix_len`` in ``pages``."""
    ids = torch.randint(3, engine.config.vocab_size, (rows,),
                        generator=torch.Generator().manual_seed(rows))  # fmt: skip
    chunk = SequenceChunk(ids.tolist(), prefix_len, pages, True)
    return build_forward_batch([chunk], engine.page_size, engine.device)


@torch.inference_mode()
def prefix_pages(engine: Engine, prefix_len: int, extra_rows: int) -> list[int]:
    """Pages for ``prefix_len + extra_rows`` tokens, the first ``prefix_len`` (random ids,
    seed 0) computed into them, `PREFILL_CHUNK` tokens a forward."""
    ps = engine.page_size
    pages = engine.allocator.alloc(-(-(prefix_len + extra_rows) // ps))
    prefix = torch.randint(3, engine.config.vocab_size, (prefix_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
    for start in range(0, prefix_len, PREFILL_CHUNK):
        chunk = SequenceChunk(prefix[start : start + PREFILL_CHUNK], start, pages, True)
        fb = build_forward_batch([chunk], ps, engine.device)
        engine.model(fb.input_ids, fb.positions, engine.kv_pool.layers, fb.attn,
                     fb.logits_indices)  # fmt: skip
    return pages


@torch.inference_mode()
def measure_rates(engine: Engine, rows: Sequence[int], prefix_lens: Sequence[int]) -> Rates:
    """The GEMM rate per row count and the attention rate per (prefix, row count), on
    one prefix of the longest length in the engine's pages (a shorter prefix is its
    first tokens)."""
    rows, prefix_lens = sorted(set(rows)), sorted(set(prefix_lens))
    pages = prefix_pages(engine, prefix_lens[-1], rows[-1])
    gemm = tuple(gemm_gflops(engine, r) for r in rows)
    attention = tuple(
        tuple(attention_gflops(engine, delta_batch(engine, pages, p, r)) for r in rows)
        for p in prefix_lens
    )
    engine.allocator.decref(pages)
    return Rates(tuple(rows), gemm, tuple(prefix_lens), attention)


def load_engine(model: str, kv_cache_memory_gib: float = 0.25) -> Engine:
    """``model`` on the CPU with the default engine settings but the prefix cache off and
    a small KV pool (0.25 GiB: 11k tokens of the default model)."""
    from radixserve.engine.engine import Engine
    from radixserve.settings import EngineSettings

    return Engine(EngineSettings(model=model, device="cpu", load_progress=False,
                                 kv_cache_memory_gib=kv_cache_memory_gib, prefix_cache=False))  # fmt: skip


def measure_compute_floor(
    model: str, rows: Sequence[int], prefix_lens: Sequence[int]
) -> tuple[ComputeFloor, dict[str, Any]]:
    """Load ``model`` (`load_engine`), measure its rates and let it go; the floor, and
    how it was measured."""
    start = time.perf_counter()
    engine = load_engine(model)
    try:
        floor = ComputeFloor(FloorShape.of(engine), measure_rates(engine, rows, prefix_lens))
        how = {"torch_threads": torch.get_num_threads(), "dtype": str(engine.dtype),
               "quantization": engine.settings.quantization}  # fmt: skip
    finally:
        engine.close()
    return floor, {**how, "seconds": time.perf_counter() - start}
