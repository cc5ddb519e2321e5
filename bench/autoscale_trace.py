"""Load traces for the autoscaler simulator: generated (a diurnal ramp with bursts) or read
from a file.

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

    def rate(self, t: float, bursts: list[float]) -> float:
        day = (1 - math.cos(2 * math.pi * t / self.duration_s)) / 2  # 0 at night, 1 at noon
        base = self.night_rps + (self.peak_rps - self.night_rps) * day
        in_burst = any(start <= t < start + self.burst_s for start in bursts)
        return base * (self.burst_factor if in_burst else 1.0)


def diurnal_trace(shape: DiurnalShape, seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals at ``shape.rate(t)`` (thinning), deterministic for a seed."""
    rng = random.Random(seed)
    bursts = sorted(rng.uniform(0.1, 0.9) * shape.duration_s for _ in range(shape.num_bursts))
    top = shape.peak_rps * shape.burst_factor
    out: list[TraceRequest] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= shape.duration_s:
            return out
        if rng.random() * top > shape.rate(t, bursts):
            continue
        n_in = _lognormal(rng, shape.mean_input_tokens, 0.6, 32, 32768)
        cached = int(n_in * min(0.95, max(0.0, rng.gauss(shape.cached_fraction, 0.2))))
        n_out = _lognormal(rng, shape.mean_output_tokens, 0.7, 1, 4096)
        out.append(TraceRequest(round(t, 4), n_in, n_out, cached))


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
