"""What `--scenario peer` runs: the presets, the options, the targets (a server in a
mode) and what a target's run gathered; shared by the runner (`peer`) and the report
(`peer_report`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from radixserve.bench import peer_servers as ps
from radixserve.bench.report import ScenarioRun
from radixserve.bench.workload import PRESETS, MultiTurnSize, RagSize

RADIXSERVE = "radixserve"
SERVERS = (RADIXSERVE, *ps.PEERS)
MODES = ("on", "busted")
WEIGHTS_NONE = "on, weights none"  # radixserve only: cache on, quantization=none


@dataclass(frozen=True)
class PeerPreset:
    multi_turn: MultiTurnSize  # run one conversation at a time
    load: RagSize  # the shared-prefix load: one document set, one question per request


def _load(requests: int) -> RagSize:
    # 4 documents ≈ 1,470 tokens + ~30 of instructions: the 1,500-token shared prefix
    return RagSize(4, 1470, requests, (60, 60), (24, 24), concurrency=4)


_SEED = PRESETS["seed"].multi_turn  # the suite's: 1,500-token system prompt, 12 rounds
PEER_PRESETS: dict[str, PeerPreset] = {
    # The suite's seed conversations (answers 130-150 tokens), 2 of them; 32 load requests.
    "seed": PeerPreset(replace(_SEED, conversations=2, concurrency=1), _load(32)),
    # 1 conversation of 6 rounds with answers of 16 tokens; 8 load requests.
    "quick": PeerPreset(
        replace(_SEED, rounds=6, conversations=1, answer_tokens=(16, 16), concurrency=1),
        _load(8),
    ),
}


@dataclass(frozen=True)
class PeerOptions:
    preset_name: str
    preset: PeerPreset
    out_path: Path
    settings: ps.PeerBenchSettings = field(default_factory=ps.PeerBenchSettings)
    model: str = "default"
    seed: int = 0
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    slots: int = 4  # llama-server -np
    servers: tuple[str, ...] = SERVERS
    peer_env: dict[str, str] = field(default_factory=dict)  # extra environment of the peers


@dataclass(frozen=True)
class Deployment:
    url: str
    settings: dict[str, Any]  # what runs, as it ran (command line, threads, dtype ...)


@dataclass(frozen=True)
class Target:
    """One server in one mode: how to start it and what every request carries."""

    server: str
    mode: str
    start: Callable[[], contextlib.AbstractContextManager[Deployment]]
    extra_body: dict[str, Any]
    unique_prefix: bool = False
    busting: str = ""  # how the cache is busted, for the table


@dataclass
class TargetRun:
    target: Target
    model_id: str
    multi_turn: ScenarioRun
    answers: list[list[str]]  # [conversation][round]: the server's answers
    load: ScenarioRun
    template_prompt_tokens: int | None  # round 1's messages, as the server counts them
    settings: dict[str, Any] = field(default_factory=dict)
