"""Load traces for the autoscaler simulator: generated — a diurnal ramp with bursts of
chat-sized prompts, or an hour of long-tailed prompts (agents, long documents) with
prefix reuse — or read from a file.

**Trace file format** (JSON Lines, one request per line, in any order)::

    {"t": 12.5, "input_tokens": 2048, "output_tokens": 180, "cached_tokens": 1536}

``t`` is the arrival time in seconds from the start of the trace; ``input_tokens`` the
prompt length; ``cached_tokens`` (default 0) how much of the prompt the cluster's cache
already holds, so only ``input_tokens - cached_tokens`` are computed; ``output_tokens``
the tokens generated. A line that is blank or starts with ``#`` is skipped; anything
else malformed is an error naming the line.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    t: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0

    @property
    def uncached_tokens(self) -> int:
        return max(1, self.input_tokens - self.cached_tokens)


@dataclass(frozen=True)
class DiurnalShape:
    """A day compressed into ``duration_s``: the rate swings between ``night_rps`` and
    ``peak_rps`` on a cosine, with ``num_bursts`` bursts of ``burst_factor`` times the
    rate lasting ``burst_s`` each, at random times; lengths are lognormal."""

    duration_s: float = 4 * 3600.0
    night_rps: float = 2.0
    peak_rps: float = 24.0
    num_bursts: int = 6
    burst_factor: float = 1.6
    burst_s: float = 180.0
    mean_input_tokens: float = 2000.0
    cached_fraction: float = 0.6  # of the input, on average (multi-turn, shared prompts)
    mean_output_tokens: float = 160.0


def diurnal_trace(shape: DiurnalShape, seed: int = 0) -> list[TraceRequest]:
    """Requests at `_arrivals` from night to peak, deterministic for a seed."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    for t in _arrivals(rng, shape.duration_s, shape.night_rps, shape.peak_rps,
                       shape.num_bursts, shape.burst_factor, shape.burst_s):  # fmt: skip
        n_in = _lognormal(rng, shape.mean_input_tokens, 0.6, 32, 32768)
        cached = int(n_in * min(0.95, max(0.0, rng.gauss(shape.cached_fraction, 0.2))))
        n_out = _lognormal(rng, shape.mean_output_tokens, 0.7, 1, 4096)
        out.append(TraceRequest(round(t, 4), n_in, n_out, cached))
    return out


@dataclass(frozen=True)
class LongTailShape:
    """An hour of production-shaped traffic: the rate rises from ``low_rps`` to
    ``high_rps`` and back on a cosine, with ``num_bursts`` bursts; a new conversation's
    prompt is log-normal (median ``median_prompt_tokens``, ``prompt_sigma``: a tail past
    64k, capped at ``max_prompt_tokens``); with probability ``continue_share`` a request
    instead continues one of the last ``open_sessions`` conversations — its prompt is that
    conversation's last prompt and answer (cached: the prefix is reused) plus a new turn."""

    duration_s: float = 3600.0
    low_rps: float = 2.0
    high_rps: float = 4.6
    num_bursts: int = 3
    burst_factor: float = 1.5
    burst_s: float = 120.0
    median_prompt_tokens: float = 6500.0
    prompt_sigma: float = 1.2
    max_prompt_tokens: int = 131072
    continue_share: float = 0.38
    open_sessions: int = 64
    median_turn_tokens: float = 300.0
    mean_output_tokens: float = 250.0


def long_tail_trace(shape: LongTailShape, seed: int = 0) -> list[TraceRequest]:
    """Requests at `_arrivals` from low to high, deterministic for a seed."""
    rng = random.Random(seed)
    sessions: list[int] = []  # open conversations: the context a next turn reuses
    out: list[TraceRequest] = []
    for t in _arrivals(rng, shape.duration_s, shape.low_rps, shape.high_rps,
                       shape.num_bursts, shape.burst_factor, shape.burst_s):  # fmt: skip
        n_out = _lognormal(rng, shape.mean_output_tokens, 0.8, 1, 4096)
        turn = int(rng.lognormvariate(math.log(shape.median_turn_tokens), 1.0)) + 1
        k = rng.randrange(len(sessions)) if sessions else -1
        if (
            k >= 0
            and rng.random() < shape.continue_share
            and (sessions[k] + turn <= shape.max_prompt_tokens)
        ):  # a next turn: the conversation so far is cached
            cached = sessions[k]
            n_in = cached + turn
            sessions[k] = n_in + n_out
        else:
            prompt = rng.lognormvariate(math.log(shape.median_prompt_tokens), shape.prompt_sigma)
            n_in, cached = max(32, min(shape.max_prompt_tokens, int(prompt))), 0
            sessions.append(n_in + n_out)
            if len(sessions) > shape.open_sessions:
                sessions.pop(rng.randrange(len(sessions)))
        out.append(TraceRequest(round(t, 4), n_in, n_out, cached))
    return out


def _arrivals(
    rng: random.Random, duration_s: float, low_rps: float, high_rps: float,
    num_bursts: int, burst_factor: float, burst_s: float,
) -> Iterator[float]:  # fmt: skip
    """Poisson arrival times (by thinning) at a rate that rises from ``low_rps`` to
    ``high_rps`` and back on a cosine over ``duration_s``, times ``burst_factor`` during
    ``num_bursts`` bursts of ``burst_s`` at random times."""
    bursts = sorted(rng.uniform(0.1, 0.9) * duration_s for _ in range(num_bursts))
    top = high_rps * burst_factor
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= duration_s:
            return
        bump = (1 - math.cos(2 * math.pi * t / duration_s)) / 2  # 0 at the ends, 1 halfway
        rate = low_rps + (high_rps - low_rps) * bump
        if any(start <= t < start + burst_s for start in bursts):
            rate *= burst_factor
        if rng.random() * top <= rate:
            yield t


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that the mean is ``mean``
    return max(lo, min(hi, int(rng.lognormvariate(mu, sigma))))


def read_trace(path: Path) -> list[TraceRequest]:
    """The requests of a JSONL trace file (format in the module notes), by arrival."""
    out: list[TraceRequest] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            row = json.loads(line)
            req = TraceRequest(
                float(row["t"]),
                int(row["input_tokens"]),
                int(row["output_tokens"]),
                int(row.get("cached_tokens", 0)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a trace line ({exc}): {line[:80]}") from None
        if req.t < 0 or req.input_tokens < 1 or req.output_tokens < 1 or req.cached_tokens < 0:
            raise ValueError(f"{path}:{number}: negative time or empty request: {line[:80]}")
        out.append(req)
    return sorted(out, key=lambda r: r.t)


def write_trace(path: Path, requests: list[TraceRequest]) -> None:
    with path.open("w") as f:
        for r in requests:
            row = {"t": r.t, "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
                   "cached_tokens": r.cached_tokens}  # fmt: skip
            f.write(json.dumps(row) + "\n")
