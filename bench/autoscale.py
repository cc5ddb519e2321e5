"""``radixserve bench --scenario autoscale``: the autoscaler's policy judged in simulation.

The real decision code (`ScalingPolicy`) drives the pool model of `autoscale_sim` over a
load trace — one of the generated shapes of `autoscale_trace` (``diurnal``: a day of
chat-sized prompts with bursts; ``long-tail``: an hour of log-normal prompts with a
tail past 64k tokens and prefix reuse) or a JSONL trace file — next to baselines in the
same run:

* **static-peak**: fixed pools sized for the trace's peak minute at the same target
  utilisation (what you provision without an autoscaler);
* **naive-reactive**: a threshold on queue depth only (prefill: queued prompt tokens per
  replica; decode: running sequences per replica), +1 above, -1 below, with a cooldown;
* **smallest-static**: the smallest fixed pools that reach the autoscaler's attainment
  over feasible requests, found by bisection over simulated runs (the fair price of
  that attainment without an autoscaler).

The autoscaler and naive-reactive start at the pools the trace's first minute needs.
The report (`autoscale_report`) gives SLO attainment over all requests and over the
feasible ones, the infeasible requests and why, replica-seconds per pool against
static-peak and smallest-static, the autoscaler's advice, and a PNG.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from radixserve.bench.autoscale_report import (
    AdviceRecorder,
    build_report,
    format_table,
    write_plot,
)
from radixserve.bench.autoscale_sim import Policy, PoolModel, SimResult, Simulator
from radixserve.bench.autoscale_trace import (
    DiurnalShape,
    LongTailShape,
    TraceRequest,
    diurnal_trace,
    long_tail_trace,
    read_trace,
)
from radixserve.services.autoscaler.observation import Decision, Observation
from radixserve.services.autoscaler.policy import ScalingPolicy
from radixserve.services.autoscaler.settings import AutoscalerSettings

TTFT_TARGET_S = 1.0
ITL_TARGET_S = 0.05
TRACE_SHAPES = ("diurnal", "long-tail")
MAX_STATIC_REPLICAS = 128  # the search for the smallest static pool stops here


def policy_settings(
    interval_s: float = 10.0, ttft_per_1k_s: float | None = None
) -> AutoscalerSettings:
    """The autoscaler's settings for the simulated pools (the defaults but the SLOs)."""
    return AutoscalerSettings(
        ttft_p90_target_s=TTFT_TARGET_S,
        itl_p90_target_s=ITL_TARGET_S,
        ttft_per_1k_tokens_s=ttft_per_1k_s,
        min_prefill=1,
        max_prefill=32,
        min_decode=1,
        max_decode=32,
        interval_s=interval_s,
    )


class StaticPolicy:
    """Never changes the pools."""

    def decide(self, obs: Observation) -> list[Decision]:
        return [
            Decision(role, p.provisioned, p.provisioned, "hold", "static")
            for role, p in obs.pools.items()
        ]


@dataclass
class NaiveReactivePolicy:
    """+1 when the queue per replica is over ``high``, -1 under ``low``, with the
    autoscaler's own cooldowns (30 s between scale-ups, 120 s before a scale-down)."""

    prefill_high_tokens: int = 8192
    prefill_low_tokens: int = 512
    decode_high_running: float = 192.0  # 3/4 of the 256-sequence batch
    decode_low_running: float = 48.0
    up_cooldown_s: float = 30.0
    down_cooldown_s: float = 120.0
    _last: dict[str, float] | None = None

    def decide(self, obs: Observation) -> list[Decision]:
        last = self._last = self._last or {"prefill": -math.inf, "decode": -math.inf}
        out = []
        for role, pool in obs.pools.items():
            ready = max(pool.ready, 1)
            if role == "prefill":
                depth = obs.prefill_queue_tokens / ready
                high, low = self.prefill_high_tokens, self.prefill_low_tokens
            else:
                depth = sum(w.running for w in obs.workers if w.role == role) / ready
                high, low = self.decode_high_running, self.decode_low_running
            desired, since = pool.provisioned, obs.now_s - last[role]
            if not pool.starting:
                if depth > high and since >= self.up_cooldown_s:
                    desired += 1
                elif depth < low and desired > 1 and since >= self.down_cooldown_s:
                    desired -= 1
            if desired != pool.provisioned:
                last[role] = obs.now_s
            direction = (
                "up"
                if desired > pool.provisioned
                else "down"
                if desired < pool.provisioned
                else "hold"
            )
            out.append(Decision(role, pool.provisioned, desired, direction, f"depth {depth:.0f}"))  # type: ignore[arg-type]
        return out


def pool_sizes(requests: list[TraceRequest], span_s: float, model: PoolModel,
               utilization: float) -> dict[str, int]:  # fmt: skip
    """Pools that carry ``requests`` arriving over ``span_s`` at ``utilization``."""
    prefill = sum(r.uncached_tokens for r in requests) / span_s
    output = sum(r.output_tokens for r in requests) / span_s
    batch = min((ITL_TARGET_S - model.decode_step_base_s) / model.decode_step_per_seq_s,
                model.max_batch)  # fmt: skip
    decode_capacity = batch / model.step_s(int(batch))
    return {
        "prefill": max(1, math.ceil(prefill / (model.prefill_tokens_per_s * utilization))),
        "decode": max(1, math.ceil(output / (decode_capacity * utilization))),
    }


def static_peak_sizes(
    trace: list[TraceRequest], model: PoolModel, utilization: float
) -> dict[str, int]:
    """Pools that carry the trace's busiest minute at ``utilization``."""
    minute: dict[int, list[TraceRequest]] = {}
    for r in trace:
        minute.setdefault(int(r.t // 60), []).append(r)
    sizes = [pool_sizes(rs, 60.0, model, utilization) for rs in minute.values()]
    return {role: max(s[role] for s in sizes) for role in ("prefill", "decode")}


def first_minute_sizes(
    trace: list[TraceRequest], model: PoolModel, utilization: float
) -> dict[str, int]:
    """Pools that carry the trace's first minute: where a running autoscaler would be."""
    return pool_sizes([r for r in trace if r.t < 60.0], 60.0, model, utilization)


Run = Callable[[dict[str, int]], SimResult]  # static pools -> their outcome


def smallest_static_pool(
    run: Run, target: float, peak: dict[str, int], peak_result: SimResult
) -> tuple[dict[str, int], SimResult] | None:
    """The smallest static pools whose attainment over feasible requests reaches
    ``target``: prefill bisected with static-peak's decode pool (twice that if
    static-peak falls short), then decode with that prefill. None if no pool up to
    `MAX_STATIC_REPLICAS` reaches it."""
    cache = {(peak["prefill"], peak["decode"]): peak_result}

    def ok(prefill: int, decode: int) -> bool:
        if (prefill, decode) not in cache:
            cache[prefill, decode] = run({"prefill": prefill, "decode": decode})
        return cache[prefill, decode].feasible_attainment >= target - 1e-12

    decode_hi = peak["decode"]
    if not ok(peak["prefill"], decode_hi):
        decode_hi = min(2 * decode_hi, MAX_STATIC_REPLICAS)
    prefill = _least(lambda p: ok(p, decode_hi), peak["prefill"])
    if prefill is None:
        return None
    decode = _least(lambda d: ok(prefill, d), decode_hi) or decode_hi
    return {"prefill": prefill, "decode": decode}, cache[prefill, decode]


def _least(good: Callable[[int], bool], guess: int) -> int | None:
    """The least n >= 1 with ``good(n)`` (monotone), starting from ``guess``; None if
    not even `MAX_STATIC_REPLICAS` is."""
    hi = max(guess, 1)
    while not good(hi):
        if hi >= MAX_STATIC_REPLICAS:
            return None
        hi = min(2 * hi, MAX_STATIC_REPLICAS)
    lo = 0  # good(lo) is false or lo is 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if good(mid):
            hi = mid
        else:
            lo = mid
    return hi


def load_trace(shape: str, quick: bool, trace_path: str | None,
               seed: int) -> tuple[list[TraceRequest], str]:  # fmt: skip
    """The requests and a description of where they came from."""
    if trace_path:
        return read_trace(Path(trace_path)), trace_path
    if shape == "long-tail":
        tail = LongTailShape()
        if quick:  # a quarter of the hour at half the rate: seconds to simulate
            tail = replace(tail, duration_s=900.0, low_rps=1.0, high_rps=2.3, num_bursts=1)
        return long_tail_trace(tail, seed), f"long-tail: {json.dumps(asdict(tail))}, seed {seed}"
    day = DiurnalShape()
    if quick:  # a compressed day at a third of the rate: seconds to simulate
        day = replace(day, duration_s=2400.0, peak_rps=8.0, num_bursts=2)
    return diurnal_trace(day, seed), f"diurnal with bursts: {json.dumps(asdict(day))}, seed {seed}"


def run_autoscale_bench(
    quick: bool = False,
    out_path: str | None = None,
    trace_path: str | None = None,
    seed: int = 0,
    shape: str = "diurnal",
    ttft_per_1k_s: float | None = None,
) -> int:
    model = PoolModel()
    try:
        trace, source = load_trace(shape, quick, trace_path, seed)
    except (OSError, ValueError) as exc:
        print(f"error: --trace: {exc}", file=sys.stderr)
        return 2
    if not trace:
        print("error: the trace holds no request", file=sys.stderr)
        return 2
    settings = policy_settings(ttft_per_1k_s=ttft_per_1k_s)
    targets = (TTFT_TARGET_S, ITL_TARGET_S)
    peak = static_peak_sizes(trace, model, settings.target_utilization)
    start = first_minute_sizes(trace, model, settings.target_utilization)

    def simulate(policy: Policy, pools: dict[str, int]) -> SimResult:
        return Simulator(trace, policy, model, pools, settings.interval_s, targets,
                         ttft_per_1k_s).run()  # fmt: skip

    recorder = AdviceRecorder(ScalingPolicy(settings))
    runs = {
        "autoscaler": (recorder, start),
        "static-peak": (StaticPolicy(), peak),
        "naive-reactive": (NaiveReactivePolicy(), start),
    }
    print(f"radixserve: simulating {len(trace)} requests over {trace[-1].t / 3600:.2f} h "
          f"({source[:80]}) ...", flush=True)  # fmt: skip
    results: dict[str, SimResult] = {}
    for name, (policy, pools) in runs.items():
        began = time.perf_counter()
        results[name] = simulate(policy, pools)
        print(f"  {name}: done in {time.perf_counter() - began:.1f} s", flush=True)
    began = time.perf_counter()
    target = results["autoscaler"].feasible_attainment
    smallest = smallest_static_pool(lambda pools: simulate(StaticPolicy(), pools), target, peak,
                                    results["static-peak"])  # fmt: skip
    print(f"  smallest-static search: done in {time.perf_counter() - began:.1f} s", flush=True)
    sizes = {"static-peak": peak, "autoscaler": start, "naive-reactive": start}
    if smallest is not None:
        sizes["smallest-static"], results["smallest-static"] = smallest
    diurnal = trace_path is None and shape == "diurnal"
    report = build_report(results, sizes, model, settings, source, recorder, diurnal)
    print(format_table(report))
    out = Path(out_path or "bench/results/autoscale.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report["timelines"] = {name: r.timeline for name, r in results.items()}
    out.write_text(json.dumps(report, indent=1))
    plot = write_plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {plot}")
    return 0
