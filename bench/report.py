"""The suite's numbers: per-request samples in, the JSON result, markdown and plots out.

Prefill FLOPs of one request (Kaplan et al. 2020, "Scaling Laws for Neural Language
Models", table 1: forward pass ≈ 2N + 2·n_layer·n_ctx·d_attn per token), summed over
the tokens the server actually computed — positions ``cached .. prompt-1``, each
attending to every position up to its own:

    FLOPs = 2·N·(prompt − cached) + 2·L·d_attn·(S(prompt) − S(cached)),  S(n) = n(n+1)/2

N: non-embedding parameters (the embedding is a lookup, and the LM head runs on the
last prompt token only); L: layers; d_attn: heads × head_dim.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# DESIGN.md §1: 70B model on 8×8 H100. Keyed by scenario, then round.
FOUNDING: dict[str, dict[int, dict[str, float]]] = {
    "multi-turn": {
        3: {"ttft_off_ms": 1840, "ttft_on_ms": 112, "ttft_cut_pct": 93.9,
            "prefill_compute_cut_pct": 68.2, "qps_gain": 2.8},
        8: {"ttft_off_ms": 3420, "ttft_on_ms": 58, "ttft_cut_pct": 98.3,
            "prefill_compute_cut_pct": 89.4, "qps_gain": 4.2},
        12: {"ttft_off_ms": 5120, "ttft_on_ms": 45, "ttft_cut_pct": 99.1,
             "prefill_compute_cut_pct": 94.6, "qps_gain": 5.8},
    },
    "rag": {
        1: {"ttft_off_ms": 2650, "ttft_on_ms": 86, "ttft_cut_pct": 96.8,
            "prefill_compute_cut_pct": 81.0, "qps_gain": 3.4},
    },
}  # fmt: skip
FLOPS_FORMULA = (
    "2*N*(prompt-cached) + 2*L*d_attn*(S(prompt)-S(cached)), S(n)=n(n+1)/2; "
    "N non-embedding params, L layers, d_attn heads*head_dim (Kaplan et al. 2020)"
)
FLOOR_TARGET = 1.3  # cached TTFT within 1.3× the cost of its delta tokens alone


@dataclass
class Sample:
    """One request as the client saw it (token counts from the server's usage)."""

    round: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float
    itl_ms: list[float] = field(default_factory=list)  # gaps between content events
    text: str = ""
    error: str | None = None  # the request failed (the peer benchmark counts, not raises)
    usage_reported: bool = True  # False: no usage in the stream, token counts unknown


@dataclass
class ScenarioRun:
    """One scenario on one deployment (cache on or off)."""

    samples: list[Sample]
    wall_s: float  # first request sent → last response ended
    floor_ms: float | None = None


@dataclass(frozen=True)
class ModelShape:
    non_embedding_params: int
    num_layers: int
    attn_dim: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        from radixserve.model.checkpoint import expected_weights

        n = sum(
            math.prod(shape)
            for name, shape in expected_weights(config)
            if "embed_tokens" not in name and "lm_head" not in name
        )
        return cls(n, config.num_layers, config.num_heads * config.head_dim)


def prefill_flops(prompt_tokens: int, cached_tokens: int, shape: ModelShape) -> float:
    def s(n: int) -> int:
        return n * (n + 1) // 2

    computed = prompt_tokens - cached_tokens
    attention = s(prompt_tokens) - s(cached_tokens)
    return (
        2.0 * shape.non_embedding_params * computed
        + 2.0 * shape.num_layers * shape.attn_dim * attention
    )


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def cut_pct(on: float | None, off: float | None) -> float | None:
    """How much smaller ``on`` is than ``off``, in percent."""
    if on is None or not off:
        return None
    return 100.0 * (1.0 - on / off)


def mode_stats(samples: Sequence[Sample], shape: ModelShape) -> dict[str, Any]:
    ttft = [s.ttft_ms for s in samples]
    itl = [gap for s in samples for gap in s.itl_ms]
    return {
        "ttft_ms": {
            "mean": statistics.fmean(ttft) if ttft else None,
            "p50": percentile(ttft, 50),
            "p90": percentile(ttft, 90),
        },
        "prefill_computed_tokens": sum(s.prompt_tokens - s.cached_tokens for s in samples),
        "cached_tokens": sum(s.cached_tokens for s in samples),
        "itl_ms": {"mean": statistics.fmean(itl) if itl else None, "p90": percentile(itl, 90)},
        "prompt_tokens": sum(s.prompt_tokens for s in samples),
        "requests": len(samples),
        "prefill_gflops": sum(
            prefill_flops(s.prompt_tokens, s.cached_tokens, shape) for s in samples
        ) / 1e9,
    }  # fmt: skip


def build_result(
    header: dict[str, Any], on: ScenarioRun, off: ScenarioRun | None, shape: ModelShape
) -> dict[str, Any]:
    """The JSON object of one scenario; ``header`` holds scenario, preset, machine,
    model and settings."""
    rounds = []
    for r in sorted({s.round for s in on.samples}):
        row: dict[str, Any] = {"round": r}
        for name, run in (("on", on), ("off", off)):
            row[name] = (
                None if run is None else mode_stats([s for s in run.samples if s.round == r], shape)
            )
        rounds.append(row)  # fmt: skip
    last = rounds[-1]
    flops_on = sum(r["on"]["prefill_gflops"] for r in rounds)
    flops_off = sum(r["off"]["prefill_gflops"] for r in rounds) if off else None
    qps_on = len(on.samples) / on.wall_s
    qps_off = len(off.samples) / off.wall_s if off else None
    cached_ms = last["on"]["ttft_ms"]["p50"]
    founding = FOUNDING[header["scenario"]]
    founding_row = max(founding)
    summary = {
        "ttft_cut_pct": cut_pct(last["on"]["ttft_ms"]["mean"],
                                last["off"]["ttft_ms"]["mean"] if off else None),
        "prefill_compute_cut_pct": cut_pct(flops_on, flops_off),
        "qps_on": qps_on,
        "qps_off": qps_off,
        "qps_gain": qps_on / qps_off if qps_off else None,
        "floor_ms": on.floor_ms,
        "cached_ttft_ms": cached_ms,
        "cached_ttft_vs_floor": cached_ms / on.floor_ms if on.floor_ms else None,
        "founding": {"round": founding_row, **founding[founding_row]},
    }  # fmt: skip
    return {**header, "rounds": rounds, "summary": summary}


def _fmt(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _ttft(stats: dict[str, Any] | None) -> str:
    if stats is None:
        return "—"
    t = stats["ttft_ms"]
    return f"{_fmt(t['mean'])} / {_fmt(t['p50'])} / {_fmt(t['p90'])}"


def markdown(result: dict[str, Any]) -> str:
    """The round table, then the summary beside the founding figures."""
    lines = [
        f"### {result['scenario']} ({result['preset']}): {result['settings']['description']}",
        "",
        "| round | prompt tokens | cached (on) | TTFT off mean / p50 / p90 (ms) | TTFT on mean / "
        "p50 / p90 (ms) | TTFT cut | prefill GFLOPs on / off | prefill compute cut (cum.) | "
        "ITL on / off (ms) | founding: TTFT cut, compute cut |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *_round_rows(result),
        "",
        f"| | TTFT cut{' (last round)' if len(result['rounds']) > 1 else ''} | prefill compute "
        "cut | QPS on / off | QPS gain | cached TTFT p50 / floor |",
        "|---|---|---|---|---|---|",
        *_summary_rows(result["scenario"], result["summary"]),
    ]
    if result["rounds"][0]["off"] is None:
        lines.append("\n(--url: the server's cache cannot be switched off, so only one run; "
                     "the off columns are empty.)")  # fmt: skip
    return "\n".join(lines)


def _round_rows(result: dict[str, Any]) -> list[str]:
    founding = FOUNDING[result["scenario"]]
    rows, gflops_on, gflops_off = [], 0.0, 0.0
    for row in result["rounds"]:
        on, off = row["on"], row["off"]
        gflops_on += on["prefill_gflops"]
        gflops_off += off["prefill_gflops"] if off else 0.0
        ttft_cut = cut_pct(on["ttft_ms"]["mean"], off["ttft_ms"]["mean"] if off else None)
        compute_cut = cut_pct(gflops_on, gflops_off or None)
        f = founding.get(row["round"])
        n = on["requests"]
        rows.append(
            f"| {row['round']} | {on['prompt_tokens'] / n:.0f} | {on['cached_tokens'] / n:.0f} | "
            f"{_ttft(off)} | {_ttft(on)} | {_fmt(ttft_cut, '.1f', ' %')} | "
            f"{on['prefill_gflops']:.1f} / {_fmt(off['prefill_gflops'] if off else None, '.1f')} | "
            f"{_fmt(compute_cut, '.1f', ' %')} | "
            f"{_fmt(on['itl_ms']['mean'])} / {_fmt(off['itl_ms']['mean'] if off else None)} | "
            + (f"{f['ttft_cut_pct']} %, {f['prefill_compute_cut_pct']} % |" if f else "|")
        )  # fmt: skip
    return rows


def _summary_rows(scenario: str, s: dict[str, Any]) -> list[str]:
    f, ratio = s["founding"], s["cached_ttft_vs_floor"]
    row = f"round {f['round']}" if scenario == "multi-turn" else "RAG row"
    verdict = "" if ratio is None else (" ✓" if ratio <= FLOOR_TARGET else " ✗")
    floor = (f"{_fmt(s['cached_ttft_ms'])} / {_fmt(s['floor_ms'])} ms = {_fmt(ratio, '.2f', '×')}"
             f" (target ≤ {FLOOR_TARGET}×){verdict}")  # fmt: skip
    return [
        f"| this run | {_fmt(s['ttft_cut_pct'], '.1f', ' %')} | "
        f"{_fmt(s['prefill_compute_cut_pct'], '.1f', ' %')} | {_fmt(s['qps_on'], '.2f')} / "
        f"{_fmt(s['qps_off'], '.2f')} | {_fmt(s['qps_gain'], '.2f', '×')} | {floor} |",
        f"| founding table ({row}) | {f['ttft_cut_pct']} % | "
        f"{f['prefill_compute_cut_pct']} % | — | {f['qps_gain']}× | — |",
    ]


def plot_paths(out_path: Path, scenario: str) -> tuple[Path, Path]:
    """Where the TTFT and prefill-compute plots of ``scenario`` go (beside the JSON)."""
    stem = out_path.with_suffix("")
    return (Path(f"{stem}-{scenario}-ttft.png"), Path(f"{stem}-{scenario}-prefill.png"))


def write_plots(result: dict[str, Any], out_path: Path) -> tuple[Path, Path]:
    """Per round, cache on vs off: TTFT (mean with p50-p90 bars, log scale, and the
    floor) and prefill GFLOPs. Returns the two PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft_path, prefill_path = plot_paths(out_path, result["scenario"])
    rounds = [r["round"] for r in result["rounds"]]
    modes = [m for m in ("off", "on") if result["rounds"][0][m] is not None]
    title = f"{result['scenario']} ({result['preset']}), {result['model']['name']}"

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in modes:
        t = [r[mode]["ttft_ms"] for r in result["rounds"]]
        mean = [x["mean"] for x in t]
        spread = [[max(0.0, m - x["p50"]) for m, x in zip(mean, t)],
                  [max(0.0, x["p90"] - m) for m, x in zip(mean, t)]]  # fmt: skip
        ax.errorbar(rounds, mean, yerr=spread, marker="o", capsize=3, label=f"prefix cache {mode}")
    floor = result["summary"]["floor_ms"]
    if floor:
        ax.axhline(floor, color="grey", linestyle="--", label="floor: delta tokens alone")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms): mean, bars p50-p90")
    _finish(fig, ax, rounds, title, ttft_path)

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = [r[mode]["prefill_gflops"] for r in result["rounds"]]
        xs = [r + (i - (len(modes) - 1) / 2) * width for r in rounds]
        ax.bar(xs, values, width, label=f"prefix cache {mode}")
    ax.set_ylabel("prefill compute (GFLOPs, all requests of the round)")
    _finish(fig, ax, rounds, title, prefill_path)
    return ttft_path, prefill_path


def _finish(fig: Any, ax: Any, rounds: list[int], title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax.set_xticks(rounds)
    ax.set_xlim(min(rounds) - 0.7, max(rounds) + 0.7)
    ax.set_xlabel("round")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
