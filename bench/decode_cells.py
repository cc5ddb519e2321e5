"""The decode scenario's data (`radixserve.bench.decode`): its options, the servers
under test, the grid's cells and what each gave; shared with its report."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixserve.bench import peer_servers as ps
from radixserve.bench.peer_options import Deployment
from radixserve.bench.report import Sample

RADIXSERVE = "radixserve"
BATCHES = (1, 4, 16, 64)
CONTEXTS = (512, 2048, 8192)
DECODE_TOKENS = 64
PREFILL_BUDGET_TOKENS = 200_000
WARMUP_IDS_SEED = 7
LLAMA_SLOT_MARGIN = 64  # tokens per llama-server slot past the context (no shift at the end)


@dataclass(frozen=True)
class DecodeOptions:
    out_path: Path
    batches: tuple[int, ...] = BATCHES
    contexts: tuple[int, ...] = CONTEXTS
    decode_tokens: int = DECODE_TOKENS
    prefill_budget_tokens: int = PREFILL_BUDGET_TOKENS
    model: str = "default"
    seed: int = 0
    engine_env: dict[str, str] = field(default_factory=dict)  # the cluster's RADIXSERVE_*
    settings: ps.PeerBenchSettings = field(default_factory=ps.PeerBenchSettings)
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)  # llama-server's
    peer_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Served:
    """What one server holds, for its floor and for the cells it can take."""

    weights: str  # in words: what the weight bytes are
    weight_bytes: int  # read once per decode step
    kv_bytes_per_token: int
    max_context: int  # the model's context limit on this server
    pool_tokens: int | None = None  # KV it holds at once; None: sized per cell (-c)
    page_size: int = 1  # the pool's granularity
    max_streams: int | None = None  # most sequences it runs at once; None: one slot each


@dataclass(frozen=True)
class System:
    """A server under test: how to start it for cells of a batch size (B and the largest
    context), what it holds, what every request carries."""

    name: str
    served: Served
    start: Callable[[int, int], contextlib.AbstractContextManager[Deployment]]
    restart_per_batch: bool
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Cell:
    batch: int
    context: int
    decode_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return self.context - self.decode_tokens


@dataclass
class CellRun:
    """One cell on one server as the client saw it."""

    streams: list[tuple[float, Sample]]  # (sent, sample) per stream
    primed: list[Sample]


@dataclass
class Outcome:
    """What happened to one cell on one server: measured (``run``), skipped or failed
    (``reason``)."""

    status: str  # "measured", "skipped", "failed"
    reason: str = ""
    run: CellRun | None = None
