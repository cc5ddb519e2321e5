"""`--scenario speculative`'s figures: per cell and method decode tokens/s, ITL, the
acceptance and tokens per verification (`cell_figures`); the JSON document, the table
and the plot of decode tokens/s by method per workload (`write_report`).

ITL: a request's mean is its decode time (first token's output to last's) over the
tokens after the first; the p50 pools every token's gap, an output carrying k tokens
counting k gaps of a k-th of the time since the one before (the tokens a verification
step appends arrive together). Decode tokens/s: the tokens after each request's first
over the time from the batch's first first-token to its last token, summed over the
batches and repeats.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.bench.speculative_options import Answer


def token_gaps_ms(answer: Answer) -> list[float]:
    """Every token's gap after the first output (an output of k tokens: k gaps of 1/k)."""
    gaps = []
    for (a, b), size in zip(zip(answer.times, answer.times[1:]), answer.sizes[1:]):
        gaps += [(b - a) * 1e3 / size] * size
    return gaps


def method_figures(runs: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """One method's figures over its repeats of a cell."""
    decode_tokens, span_s, itl_means, gaps, outputs = 0, 0.0, [], [], 0
    totals = {"steps": 0, "drafted": 0, "accepted": 0, "emitted": 0}
    for run in runs:
        conversations = run["answers"]
        for lo in range(0, len(conversations), batch):
            group = conversations[lo : lo + batch]
            for turn in range(max(len(c) for c in group)):
                answers = [c[turn] for c in group if turn < len(c) and c[turn].times]
                if not answers:
                    continue
                span_s += max(a.times[-1] for a in answers) - min(a.times[0] for a in answers)
                for a in answers:
                    decode_tokens += len(a.token_ids) - 1
                    outputs += len(a.times) - 1
                    if len(a.token_ids) > 1:
                        itl_means.append((a.times[-1] - a.times[0]) * 1e3 / (len(a.token_ids) - 1))
                    gaps += token_gaps_ms(a)
        for key in totals:
            totals[key] += run["counters"][key]
    return {
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / span_s if span_s > 0 else None,
        "itl_ms": {
            "mean": statistics.mean(itl_means) if itl_means else None,
            "p50": statistics.median(gaps) if gaps else None,
        },  # fmt: skip
        "acceptance": totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
        "tokens_per_verification": totals["emitted"] / totals["steps"] if totals["steps"] else None,
        "tokens_per_output": decode_tokens / outputs if outputs else None,
        "counters": totals,
    }


def cell_figures(workload: str, batch: int, max_tokens: int, runs: dict[str, list[dict[str, Any]]],
                 reference: str) -> dict[str, Any]:  # fmt: skip
    """The figures of every method on one (workload, batch), with ratios to ``reference``."""
    methods = {m: method_figures(r, batch) for m, r in runs.items()}
    base = methods[reference]
    for figures in methods.values():
        tps, base_tps = figures["decode_tokens_per_s"], base["decode_tokens_per_s"]
        itl, base_itl = figures["itl_ms"]["mean"], base["itl_ms"]["mean"]
        figures["tokens_per_s_vs_off"] = tps / base_tps if tps and base_tps else None
        figures["itl_mean_vs_off"] = itl / base_itl if itl and base_itl else None
    return {"workload": workload, "batch": batch, "max_tokens": max_tokens,
            "repeats": len(next(iter(runs.values()))), "methods": methods}  # fmt: skip


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _per_token(figures: dict[str, Any]) -> float | None:
    """Draft tokens verified per token decoded."""
    tokens = figures["decode_tokens"]
    return figures["counters"]["drafted"] / tokens if tokens else None


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"speculative decoding, {env['date_utc']}, {env['host']} ({env['cpu_count']} cores), "
        f"load average {' '.join(f'{x:.2f}' for x in env['load_average'])} at start",
        "",
        "| workload | B | method | decode tok/s | x off | ITL mean ms | ITL p50 ms | "
        "drafted/token | acceptance | tokens/verification | same as off |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    bad = {(m["workload"], m["batch"], m["method"]) for m in report["mismatches"]}
    for cell in report["cells"]:
        for method, f in cell["methods"].items():
            same = "NO" if (cell["workload"], cell["batch"], method) in bad else "yes"
            lines.append(
                f"| {cell['workload']} | {cell['batch']} | {method} | "
                f"{_num(f['decode_tokens_per_s'], '.1f')} | {_num(f['tokens_per_s_vs_off'], '.2f')} | "
                f"{_num(f['itl_ms']['mean'], '.2f')} | {_num(f['itl_ms']['p50'], '.2f')} | "
                f"{_num(_per_token(f), '.2f')} | {_num(f['acceptance'], '.2f')} | "
                f"{_num(f['tokens_per_verification'], '.2f')} | {same} |"
            )  # fmt: skip
    cluster = report.get("cluster")
    if cluster:
        lines += ["", "through `radixserve up` (batch 1, streamed):", "",
                  "| workload | method | ITL mean ms | ITL p50 chunk ms | x off (ITL) | "
                  "acceptance (/metrics) | tokens/verification |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in cluster["cells"]:
            lines.append(
                f"| {row['workload']} | {row['method']} | {_num(row['itl_ms']['mean'], '.2f')} | "
                f"{_num(row['itl_ms']['p50_chunk'], '.2f')} | {_num(row.get('itl_mean_vs_off'), '.2f')} | "
                f"{_num(row['acceptance'], '.2f')} | {_num(row['tokens_per_verification'], '.2f')} |"
            )  # fmt: skip
    lines.append("")
    lines.append(f"answers differing from off's: {len(report['mismatches'])}"
                 + ("  <-- ERROR" if report["mismatches"] else ""))  # fmt: skip
    return "\n".join(lines)


def plot_path(out_path: Path) -> Path:
    return out_path.with_name(f"{out_path.stem}-tokens-per-s.png")


def write_plot(report: dict[str, Any], path: Path) -> Path | None:
    """Decode tokens/s by method, one panel per batch size, workloads side by side;
    None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({c["batch"] for c in report["cells"]})
    methods = list(report["cells"][0]["methods"])
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    width = 0.8 / len(methods)
    for ax, batch in zip(axes[0], batches):
        cells = [c for c in report["cells"] if c["batch"] == batch]
        for i, method in enumerate(methods):
            values = [c["methods"][method]["decode_tokens_per_s"] or 0 for c in cells]
            ax.bar([x + i * width for x in range(len(cells))], values, width, label=method)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cells))],
                      [c["workload"] for c in cells], fontsize=8)  # fmt: skip
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"batch {batch}", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"speculative decoding by method, {report['environment']['date_utc']}",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(report: dict[str, Any], out_path: Path) -> None:
    """The plot beside the JSON, the JSON, the table on stdout."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    plot = write_plot(report, plot_path(out_path)) if report["cells"] else None
    report["plot"] = None if plot is None else str(plot)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"speculative: wrote {out_path}" + (f" and {plot}" if plot else ""), file=sys.stderr)
