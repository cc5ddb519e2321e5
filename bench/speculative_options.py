"""The speculative scenario's options and its one answer type, shared by its modules
(`speculative`, `speculative_report`, `speculative_cluster`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from radixserve.bench.speculative_workloads import WORKLOADS
from radixserve.engine.speculation import METHODS, SpeculativeMethod


@dataclass(frozen=True)
class SpeculativeOptions:
    workloads: tuple[str, ...] = WORKLOADS
    batches: tuple[int, ...] = (1, 16)
    methods: tuple[SpeculativeMethod, ...] = METHODS
    repeats: int = 2
    #: conversations per batch-1 cell (a batch-B cell runs B) ...
    batch1_conversations: int = 3
    #: ... but for these workloads: cross-request's users, 8 a question (after its prime)
    conversations: dict[str, int] = field(default_factory=lambda: {"cross-request": 16})
    #: max_tokens per workload (the rest: `default_max_tokens`)
    max_tokens: dict[str, int] = field(default_factory=lambda: {"code-edit": 256})
    default_max_tokens: int = 128
    seed: int = 0
    model: str = "default"
    out_path: Path = Path("bench/results/speculative.json")
    through_cluster: bool = False


#: a smoke run: 2 workloads, batch 1, one repeat, short answers (about a minute on 2 cores)
QUICK = SpeculativeOptions(workloads=("code-edit", "rag"), batches=(1,), repeats=1,
                           batch1_conversations=2, conversations={}, max_tokens={"code-edit": 96},
                           default_max_tokens=64)  # fmt: skip


@dataclass
class Answer:
    """One turn's answer: its tokens and when each engine output carrying them came."""

    token_ids: list[int]
    text: str
    times: list[float]  # perf_counter of each output with tokens
    sizes: list[int]  # tokens in each output
