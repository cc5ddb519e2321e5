"""The LoRA scenario's engine side (`bench/lora.py`): its options, the engine it drives,
a batch of streams run to the end, and the adapters written and loaded for it."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixserve.bench.lora_adapters import DEFAULT_STRENGTH, write_adapter
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.settings import EngineSettings


@dataclass(frozen=True)
class LoraOptions:
    batch: int = 16  # requests decoding at once
    decode_tokens: int = 64  # each request's tokens (min_tokens = max_tokens)
    adapter_counts: tuple[int, ...] = (0, 1, 4, 16)  # distinct adapters per batch
    repeats: int = 3
    prompt_tokens: int = 64  # each throughput request's prompt (distinct)
    rank: int = 16
    strength: float = DEFAULT_STRENGTH
    swap_repeats: int = 5
    chat_adapters: int = 4  # chats with an adapter (and one with the base model)
    chat_turns: int = 3
    chat_context_tokens: int = 512  # the first turn's shared notes
    chat_answer_tokens: int = 32
    seed: int = 0
    model: str = "default"
    out_path: Path = Path("bench/results/lora.json")

    @property
    def max_loras(self) -> int:
        """Device slots: every adapter of the largest batch variant at once."""
        return max(1, *self.adapter_counts)


#: a smoke run, about a minute on 2 cores: 8 requests of 32 tokens, up to 8 adapters, once
QUICK = LoraOptions(batch=8, decode_tokens=32, adapter_counts=(0, 1, 4, 8), repeats=1,
                    swap_repeats=3, chat_context_tokens=256, chat_answer_tokens=24,
                    out_path=Path("bench/results/lora-quick.json"))  # fmt: skip

#: builds the engine, given its ``max_loras``
EngineFactory = Callable[[int], Engine]


def progress(message: str) -> None:
    print(f"[lora {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def default_factory(options: LoraOptions) -> EngineFactory:
    """The engine of ``options.model`` on the CPU, the defaults but ``max_loras``."""

    def make(max_loras: int) -> Engine:
        return Engine(EngineSettings(model=options.model, device="cpu", load_progress=False,
                                     max_loras=max_loras))  # fmt: skip

    return make


@dataclass
class Stream:
    """One request's answer: its tokens and when each engine output carrying them came."""

    adapter: str
    token_ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # perf_counter of each output with tokens
    sizes: list[int] = field(default_factory=list)  # tokens in each output
    text: str = ""
    ttft_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


class NativeSteps:
    """Counts the steps the native decode step computes while it is entered (the runner's
    `FusedDecode.forward`, wrapped on its instance and restored on exit)."""

    def __init__(self, engine: Engine) -> None:
        self.fused = engine.runner.fused
        self.count = 0

    def __enter__(self) -> NativeSteps:
        if self.fused is not None:
            inner = self.fused.forward

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.count += 1
                return inner(*args, **kwargs)

            setattr(self.fused, "forward", counted)  # noqa: B010 (an instance attribute)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fused is not None:
            delattr(self.fused, "forward")  # the class's method again


def run_batch(engine: Engine, jobs: Sequence[tuple[list[int], str]],
              params: SamplingParams) -> tuple[list[Stream], int]:  # fmt: skip
    """Run ``jobs`` (prompt, adapter) queued at once to the end: their streams in order
    and the engine steps taken."""
    ids = [engine.add_request(prompt, params, adapter=adapter) for prompt, adapter in jobs]
    streams = {i: Stream(adapter) for i, (_, adapter) in zip(ids, jobs)}
    steps = 0
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            if out.new_token_ids:
                stream.token_ids += out.new_token_ids
                stream.text += out.new_text
                stream.times.append(now)
                stream.sizes.append(len(out.new_token_ids))
            if out.finished:
                stream.ttft_ms, stream.prompt_tokens = out.ttft_ms, out.prompt_tokens
                stream.cached_tokens = out.cached.total
    return [streams[i] for i in ids], steps


def adapter_names(count: int) -> list[str]:
    return [f"adapter-{i:02d}" for i in range(count)]


def make_adapters(engine: Engine, folder: Path, names: Sequence[str],
                  options: LoraOptions, seed: int) -> list[float]:  # fmt: skip
    """Write and load one adapter per name (seeds from ``seed``): each load's seconds."""
    load_s = []
    for i, name in enumerate(names):
        path = write_adapter(folder / name, engine.config, options.rank, seed + i,
                             options.strength)  # fmt: skip
        started = time.perf_counter()
        engine.load_lora(name, str(path))
        load_s.append(time.perf_counter() - started)
    return load_s
