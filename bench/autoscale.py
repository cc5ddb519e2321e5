"""``radixserve bench --scenario autoscale``: the autoscaler's policy judged in simulation.

The real decision code (`ScalingPolicy`) drives the pool model of `autoscale_sim` over a
load trace — the diurnal ramp with bursts of `autoscale_trace`, or a JSONL trace file —
next to two baselines in the same run:

* **static-peak**: fixed pools sized for the trace's peak minute at the same target
  utilisation (what you provision without an autoscaler);
* **naive-reactive**: a threshold on queue depth only (prefill: queued prompt tokens per
  replica; decode: running sequences per replica), +1 above, -1 below, with a cooldown.

It prints SLO attainment (share of requests within both the TTFT and the ITL target),
replica-seconds per pool and scale events for each, the autoscaler's replica-seconds
over static-peak's, writes JSON and a PNG (load, replicas, p90 latencies over time).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from radixserve.bench.autoscale_sim import PoolModel, SimResult, Simulator
from radixserve.bench.autoscale_trace import DiurnalShape, TraceRequest, diurnal_trace, read_trace
from radixserve.services.autoscaler.policy import Decision, Observation, ScalingPolicy
from radixserve.services.autoscaler.settings import AutoscalerSettings

TTFT_TARGET_S = 1.0
ITL_TARGET_S = 0.05
ATTAINMENT_TARGET = 0.95
REPLICA_SECONDS_TARGET = 0.70  # of static-peak's


def policy_settings(interval_s: float = 10.0) -> AutoscalerSettings:
    """The autoscaler's settings for the simulated pools (the defaults but the SLOs)."""
    return AutoscalerSettings(
        ttft_p90_target_s=TTFT_TARGET_S,
        itl_p90_target_s=ITL_TARGET_S,
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


def static_peak_sizes(
    trace: list[TraceRequest], model: PoolModel, utilization: float
) -> dict[str, int]:
    """Pools that carry the trace's busiest minute at ``utilization``."""
    minute: dict[int, list[TraceRequest]] = {}
    for r in trace:
        minute.setdefault(int(r.t // 60), []).append(r)
    peak_prefill = max(sum(r.uncached_tokens for r in rs) / 60 for rs in minute.values())
    peak_output = max(sum(r.output_tokens for r in rs) / 60 for rs in minute.values())
    batch = min((ITL_TARGET_S - model.decode_step_base_s) / model.decode_step_per_seq_s,
                model.max_batch)  # fmt: skip
    decode_capacity = batch / model.step_s(int(batch))
    return {
        "prefill": math.ceil(peak_prefill / (model.prefill_tokens_per_s * utilization)),
        "decode": math.ceil(peak_output / (decode_capacity * utilization)),
    }


def run_autoscale_bench(
    quick: bool = False, out_path: str | None = None, trace_path: str | None = None, seed: int = 0
) -> int:
    model = PoolModel()
    if trace_path:
        trace = read_trace(Path(trace_path))
        source = trace_path
    else:
        shape = DiurnalShape()
        if quick:  # a compressed day at a third of the rate: seconds to simulate
            shape = replace(shape, duration_s=2400.0, peak_rps=8.0, num_bursts=2)
        trace = diurnal_trace(shape, seed)
        source = f"diurnal with bursts: {json.dumps(asdict(shape))}, seed {seed}"
    if not trace:
        print("error: the trace holds no request", file=sys.stderr)
        return 2
    settings = policy_settings()
    peak = static_peak_sizes(trace, model, settings.target_utilization)
    initial = {"prefill": 1, "decode": 1}
    runs = {
        "autoscaler": (ScalingPolicy(settings), initial),
        "static-peak": (StaticPolicy(), peak),
        "naive-reactive": (NaiveReactivePolicy(), initial),
    }
    results: dict[str, SimResult] = {}
    print(f"radixserve: simulating {len(trace)} requests over {trace[-1].t / 3600:.2f} h "
          f"({source[:80]}) ...", flush=True)  # fmt: skip
    for name, (policy, start) in runs.items():
        began = time.perf_counter()
        sim = Simulator(trace, policy, model, start, settings.interval_s,
                        (TTFT_TARGET_S, ITL_TARGET_S))  # fmt: skip
        results[name] = sim.run()
        print(f"  {name}: done in {time.perf_counter() - began:.1f} s", flush=True)
    report = _report(results, model, peak, source, len(trace))
    print(format_table(report))
    out = Path(out_path or "bench/results/autoscale.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report["timelines"] = {name: r.timeline for name, r in results.items()}
    out.write_text(json.dumps(report, indent=1))
    plot = write_plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {plot}")
    return 0


def _report(results: dict[str, SimResult], model: PoolModel, peak: dict[str, int],
            source: str, n: int) -> dict[str, Any]:  # fmt: skip
    total = {name: sum(r.replica_seconds.values()) for name, r in results.items()}
    auto, static, naive = results["autoscaler"], results["static-peak"], results["naive-reactive"]
    share = total["autoscaler"] / total["static-peak"]
    return {
        "trace": source,
        "requests": n,
        "targets": {"ttft_p90_s": TTFT_TARGET_S, "itl_p90_s": ITL_TARGET_S},
        "pool_model": asdict(model),
        "static_peak_sizes": peak,
        "policies": {
            name: {
                "attainment": r.attainment,
                "ttft_attainment": r.ttft_attainment,
                "itl_attainment": r.itl_attainment,
                "replica_seconds": r.replica_seconds,
                "replica_seconds_total": total[name],
                "scale_events": r.scale_events,
            }
            for name, r in results.items()
        },
        "autoscaler_vs_static_replica_seconds": share,
        "checks": {
            f"autoscaler attainment >= {ATTAINMENT_TARGET:.0%}": auto.attainment >= ATTAINMENT_TARGET,
            f"replica-seconds <= {REPLICA_SECONDS_TARGET:.0%} of static-peak": share <= REPLICA_SECONDS_TARGET,
            "autoscaler attainment > naive-reactive": auto.attainment > naive.attainment,
            "static-peak attainment (reference)": static.attainment >= ATTAINMENT_TARGET,
        },
    }  # fmt: skip


def format_table(report: dict[str, Any]) -> str:
    rows = [
        "| policy | SLO attainment | TTFT ok | ITL ok | prefill replica-s | decode replica-s "
        "| total / static | scale events |",
        "|---|---|---|---|---|---|---|---|",
    ]
    static = report["policies"]["static-peak"]["replica_seconds_total"]
    for name, p in report["policies"].items():
        events = p["scale_events"]
        rows.append(
            f"| {name} | {p['attainment']:.1%} | {p['ttft_attainment']:.1%} | "
            f"{p['itl_attainment']:.1%} | {p['replica_seconds']['prefill']:,.0f} | "
            f"{p['replica_seconds']['decode']:,.0f} | {p['replica_seconds_total'] / static:.2f} | "
            f"{events['prefill']} + {events['decode']} |"
        )
    checks = "\n".join(
        f"- {'PASS' if ok else 'MISS'}: {what}" for what, ok in report["checks"].items()
    )
    sizes = report["static_peak_sizes"]
    head = (f"{report['requests']} requests; targets TTFT p90 {report['targets']['ttft_p90_s']} s, "
            f"ITL p90 {report['targets']['itl_p90_s']} s; static-peak pools: "
            f"{sizes['prefill']} prefill + {sizes['decode']} decode")  # fmt: skip
    return f"{head}\n\n" + "\n".join(rows) + f"\n\n{checks}"


def write_plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    styles = {"autoscaler": "-", "static-peak": ":", "naive-reactive": "--"}
    for name, points in report["timelines"].items():
        t = [p["t"] / 3600 for p in points]
        if name == "autoscaler":
            axes[0].plot(t, [p["requests_per_s"] for p in points], color="black", lw=0.8)
        for ax, key in ((axes[1], "prefill_replicas"), (axes[2], "decode_replicas")):
            ax.plot(t, [p[key] for p in points], styles[name], label=name)
        ttft = [p["ttft_p90_s"] if p["ttft_p90_s"] is not None else math.nan for p in points]
        itl = [p["itl_p90_s"] if p["itl_p90_s"] is not None else math.nan for p in points]
        axes[3].plot(t, [x / report["targets"]["ttft_p90_s"] for x in ttft], styles[name],
                     label=f"{name} TTFT p90 / target", lw=0.8)  # fmt: skip
        axes[3].plot(t, [x / report["targets"]["itl_p90_s"] for x in itl], styles[name],
                     label=f"{name} ITL p90 / target", lw=0.8, alpha=0.6)  # fmt: skip
    axes[0].set_ylabel("requests/s")
    axes[1].set_ylabel("prefill replicas")
    axes[2].set_ylabel("decode replicas")
    axes[3].set_ylabel("p90 / target")
    axes[3].axhline(1.0, color="red", lw=0.6)
    axes[3].set_yscale("log")
    axes[3].set_xlabel("hours")
    for ax in axes[1:]:
        ax.legend(fontsize=7)
    fig.suptitle("radixserve autoscaler in simulation (bench --scenario autoscale)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
