"""The autoscale benchmark's report: the numbers a user needs to judge the policy.

For each policy: SLO attainment over all requests and over the feasible ones (a request
is infeasible when its own prefill alone exceeds its TTFT target — no pool serves it in
time), replica-seconds per pool, their ratio to static-peak's and to the smallest static
pools that reach the autoscaler's attainment, scale events. For the trace: how many
requests are infeasible and why, with the prefill rate the model assumed; when that
share is sizeable, the remedies the cluster offers and what the autoscaler advised.
Printed as a table, written as JSON and a PNG (load with the infeasible requests marked,
replicas per pool, p90 latencies over time).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from radixserve.bench.autoscale_sim import PoolModel, SimResult
from radixserve.services.autoscaler.feasibility import REMEDIES
from radixserve.services.autoscaler.observation import Decision, Observation
from radixserve.services.autoscaler.policy import ScalingPolicy
from radixserve.services.autoscaler.settings import AutoscalerSettings

ATTAINMENT_TARGET = 0.95  # over feasible requests
SMALLEST_STATIC_FACTOR = 1.5  # autoscaler replica-seconds over smallest-static's, at most
REPLICA_SECONDS_TARGET = 0.70  # of static-peak's


@dataclass
class AdviceRecorder:
    """The autoscaler's policy, keeping what it advised (for the report)."""

    policy: ScalingPolicy
    advised_intervals: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    last_advice: dict[str, str] = field(default_factory=dict)

    def decide(self, obs: Observation) -> list[Decision]:
        decisions = self.policy.decide(obs)
        for d in decisions:
            if d.advice:
                self.advised_intervals[d.role] += 1
                self.last_advice[d.role] = d.advice
        return decisions


def build_report(
    results: dict[str, SimResult],
    sizes: dict[str, dict[str, int]],
    model: PoolModel,
    settings: AutoscalerSettings,
    source: str,
    recorder: AdviceRecorder,
    diurnal: bool,
) -> dict[str, Any]:
    """The report; ``diurnal``: the trace is the diurnal shape, whose replica-seconds
    target against static-peak is checked too."""
    total = {name: sum(r.replica_seconds.values()) for name, r in results.items()}
    auto = results["autoscaler"]
    smallest = total.get("smallest-static")
    policies = {}
    for name, r in results.items():
        policies[name] = {
            "pools": sizes.get(name),
            "attainment": r.attainment,
            "feasible_attainment": r.feasible_attainment,
            "ttft_attainment": r.ttft_attainment,
            "itl_attainment": r.itl_attainment,
            "replica_seconds": r.replica_seconds,
            "replica_seconds_total": total[name],
            "vs_static_peak": total[name] / total["static-peak"],
            "vs_smallest_static": None if smallest is None else total[name] / smallest,
            "scale_events": r.scale_events,
        }
    infeasible = _infeasible(auto, model, settings)
    return {
        "trace": source,
        "requests": auto.requests,
        "targets": {
            "ttft_p90_s": settings.ttft_p90_target_s,
            "itl_p90_s": settings.itl_p90_target_s,
            "ttft_per_1k_tokens_s": settings.ttft_per_1k_tokens_s,
        },  # fmt: skip
        "pool_model": asdict(model),
        "infeasible": infeasible,
        "advice": _advice(infeasible["share"], settings, recorder),
        "policies": policies,
        "checks": _checks(policies, diurnal),
    }


def _infeasible(auto: SimResult, model: PoolModel, settings: AutoscalerSettings) -> dict[str, Any]:
    """How many requests no pool serves in time, and why."""
    target, per_1k = settings.ttft_p90_target_s, settings.ttft_per_1k_tokens_s
    over = (target - model.prefill_overhead_s) * model.prefill_tokens_per_s
    if per_1k is not None and per_1k * model.prefill_tokens_per_s >= 1000:
        over = math.inf  # the budget grows faster than the compute: every request fits
    budget = "" if per_1k is None else f" (or {per_1k:g} s per 1k uncached tokens if larger)"
    why = (f"own prefill = uncached tokens / {model.prefill_tokens_per_s:,.0f} tokens/s + "
           f"{model.prefill_overhead_s * 1000:g} ms per request, over the {target:g} s TTFT "
           f"target{budget}")  # fmt: skip
    if math.isfinite(over):
        why += f": every request over {over:,.0f} uncached tokens"
    return {
        "requests": auto.infeasible,
        "share": auto.infeasible / max(auto.requests, 1),
        "why": why,
        "prefill_tokens_per_s": model.prefill_tokens_per_s,
        "prefill_overhead_s": model.prefill_overhead_s,
        "over_uncached_tokens": over if math.isfinite(over) else None,
    }


def _advice(share: float, settings: AutoscalerSettings, recorder: AdviceRecorder) -> dict[str, Any]:
    """The remedies when a sizeable share is infeasible, and what the autoscaler said."""
    sizeable = share >= settings.infeasible_advice_share
    return {
        "sizeable_share": settings.infeasible_advice_share,
        "advised": sizeable,
        "remedies": [text for _, text in REMEDIES["ttft"]] if sizeable else [],
        "autoscaler_intervals": dict(recorder.advised_intervals),
        "autoscaler_last": dict(recorder.last_advice),
    }


def _checks(policies: dict[str, dict[str, Any]], diurnal: bool) -> dict[str, bool | None]:
    auto, naive = policies["autoscaler"], policies["naive-reactive"]
    checks = {
        f"autoscaler attainment over feasible requests >= {ATTAINMENT_TARGET:.0%}":
            auto["feasible_attainment"] >= ATTAINMENT_TARGET,
        f"replica-seconds <= {SMALLEST_STATIC_FACTOR:g}x the smallest static pools reaching "
        "the same attainment": None if auto["vs_smallest_static"] is None
            else auto["vs_smallest_static"] <= SMALLEST_STATIC_FACTOR,
        "autoscaler attainment over feasible requests > naive-reactive's":
            auto["feasible_attainment"] > naive["feasible_attainment"],
    }  # fmt: skip
    if diurnal:  # a day's swing leaves most of static-peak's pools idle most of the time
        checks[f"replica-seconds <= {REPLICA_SECONDS_TARGET:.0%} of static-peak's"] = (
            auto["vs_static_peak"] <= REPLICA_SECONDS_TARGET
        )
    return checks


def format_table(report: dict[str, Any]) -> str:
    rows = [
        "| policy | pools | SLO attainment | over feasible | TTFT ok | ITL ok | prefill "
        "replica-s | decode replica-s | / static-peak | / smallest-static | scale events |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in report["policies"].items():
        pools = p["pools"]
        start = "" if pools is None else f"{pools['prefill']} + {pools['decode']}"
        versus = p["vs_smallest_static"]
        events = p["scale_events"]
        rows.append(
            f"| {name} | {start} | {p['attainment']:.2%} | {p['feasible_attainment']:.2%} | "
            f"{p['ttft_attainment']:.2%} | {p['itl_attainment']:.2%} | "
            f"{p['replica_seconds']['prefill']:,.0f} | {p['replica_seconds']['decode']:,.0f} | "
            f"{p['vs_static_peak']:.2f} | {'-' if versus is None else f'{versus:.2f}'} | "
            f"{events['prefill']} + {events['decode']} |"
        )
    marks = {True: "PASS", False: "MISS", None: "n/a "}
    checks = "\n".join(f"- {marks[ok]}: {what}" for what, ok in report["checks"].items())
    t, inf = report["targets"], report["infeasible"]
    head = (f"{report['requests']} requests; targets TTFT p90 {t['ttft_p90_s']} s, ITL p90 "
            f"{t['itl_p90_s']} s; pools (prefill + decode) at the start or fixed")  # fmt: skip
    lines = [f"infeasible: {inf['requests']} requests ({inf['share']:.1%}): {inf['why']}"]
    advice = report["advice"]
    if advice["advised"]:
        lines.append("a sizeable share cannot meet the TTFT target on any pool; instead of "
                     "replicas: " + "; ".join(advice["remedies"]))  # fmt: skip
    for role, n in advice["autoscaler_intervals"].items():
        if n:
            lines.append(f"the autoscaler advised ({role}) in {n} intervals, last: "
                         f"{advice['autoscaler_last'][role]}")  # fmt: skip
    return f"{head}\n\n" + "\n".join(rows) + "\n\n" + "\n".join(lines) + f"\n\n{checks}"


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def write_plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    styles = {"autoscaler": "-", "static-peak": ":", "naive-reactive": "--",
              "smallest-static": "-."}  # fmt: skip
    targets = report["targets"]
    for name, points in report["timelines"].items():
        t = [p["t"] / 3600 for p in points]
        if name == "autoscaler":
            axes[0].plot(t, [p["requests_per_s"] for p in points], color="black", lw=0.8,
                         label="arriving")  # fmt: skip
            infeasible = [p["infeasible_per_s"] for p in points]
            axes[0].fill_between(t, infeasible, color="red", alpha=0.5, lw=0,
                                 label="infeasible: own prefill over the TTFT target")  # fmt: skip
        for ax, key in ((axes[1], "prefill_replicas"), (axes[2], "decode_replicas")):
            ax.plot(t, [p[key] for p in points], styles[name], label=name)
        ttft = [_nan(p["feasible_ttft_p90_s"]) for p in points]
        itl = [_nan(p["itl_p90_s"]) for p in points]
        axes[3].plot(t, [x / targets["ttft_p90_s"] for x in ttft], styles[name],
                     label=f"{name} TTFT p90 / target", lw=0.8)  # fmt: skip
        axes[3].plot(t, [x / targets["itl_p90_s"] for x in itl], styles[name],
                     label=f"{name} ITL p90 / target", lw=0.8, alpha=0.6)  # fmt: skip
    axes[0].set_ylabel("requests/s")
    axes[1].set_ylabel("prefill replicas")
    axes[2].set_ylabel("decode replicas")
    axes[3].set_ylabel("p90 / target (TTFT: feasible requests)")
    axes[3].axhline(1.0, color="red", lw=0.6)
    axes[3].set_yscale("log")
    axes[3].set_xlabel("hours")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle("radixserve autoscaler in simulation (bench --scenario autoscale)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
