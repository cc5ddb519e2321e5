"""`--scenario lora`'s figures (`throughput_figures`), its checks (`problems`), and the
JSON document, the table and the plot of decode tokens/s against adapters
(`write_report`).

Decode tokens/s: the tokens after each request's first over the time from the batch's
first first-token to its last token, summed over the repeats (and per repeat, with each
repeat's ratio to the base model's run in the same repeat); ITL mean: per request,
its decode time over the tokens after its first, averaged; ITL p50/p90: every gap
between two outputs of a request (one token each here: no speculation).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.bench.lora_engine import Stream

#: the issue's target: a batch over 4 adapters at this fraction of the base model's tokens/s
TARGET_RATIO = 0.7


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _variant(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One adapter count's figures over its repeats."""
    decode_tokens, span_s, itl_means, gaps, per_repeat, ttfts = 0, 0.0, [], [], [], []
    counts = []
    for run in runs:
        streams: list[Stream] = run["streams"]
        span = max(s.times[-1] for s in streams) - min(s.times[0] for s in streams)
        tokens = sum(len(s.token_ids) - 1 for s in streams)
        decode_tokens, span_s = decode_tokens + tokens, span_s + span
        per_repeat.append(tokens / span if span > 0 else None)
        for s in streams:
            counts.append(len(s.token_ids))
            ttfts.append(s.ttft_ms or 0.0)
            if len(s.token_ids) > 1:
                itl_means.append((s.times[-1] - s.times[0]) * 1e3 / (len(s.token_ids) - 1))
            gaps += [(b - a) * 1e3 for a, b in zip(s.times, s.times[1:])]
    steps = sum(r["steps"] for r in runs)
    return {
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / span_s if span_s > 0 else None,
        "per_repeat_tokens_per_s": per_repeat,
        "itl_ms": {
            "mean": statistics.mean(itl_means) if itl_means else None,
            "p50": _quantile(gaps, 0.5),
            "p90": _quantile(gaps, 0.9),
        },  # fmt: skip
        "ttft_ms_mean": statistics.mean(ttfts) if ttfts else None,
        "tokens_per_request": sorted(set(counts)),
        "steps": steps,
        "native_steps": sum(r["native_steps"] for r in runs),
    }


def throughput_figures(runs: dict[int, list[dict[str, Any]]], decode_tokens: int, batch: int,
                       order: list[list[int]]) -> dict[str, Any]:  # fmt: skip
    """Every adapter count's figures, with its ratio to the base model's (count 0)."""
    variants = {count: _variant(r) for count, r in runs.items()}
    base = variants.get(0, {}).get("decode_tokens_per_s")
    base_itl = variants.get(0, {}).get("itl_ms", {}).get("mean")
    rows = []
    base_repeats = variants.get(0, {}).get("per_repeat_tokens_per_s", [])
    for count, figures in variants.items():
        tps, itl = figures["decode_tokens_per_s"], figures["itl_ms"]["mean"]
        figures["tokens_per_s_vs_base"] = tps / base if tps and base else None
        # each repeat's ratio to the base model's run of the same repeat (paired: the
        # machine's drift between repeats cancels)
        paired = [v / b for v, b in zip(figures["per_repeat_tokens_per_s"], base_repeats)
                  if v and b]  # fmt: skip
        figures["per_repeat_vs_base"] = paired
        figures["median_repeat_vs_base"] = statistics.median(paired) if paired else None
        figures["itl_mean_vs_base"] = itl / base_itl if itl and base_itl else None
        rows.append({"adapters": count, **figures})
    return {"batch": batch, "decode_tokens": decode_tokens, "order": order, "variants": rows}


def problems(report: dict[str, Any]) -> list[str]:
    """What the run shows to be wrong (the command exits 1 on any)."""
    found = []
    want = report["throughput"]["decode_tokens"]
    for row in report["throughput"]["variants"]:
        if row["tokens_per_request"] != [want]:
            found.append(f"{row['adapters']} adapter(s): requests decoded "
                         f"{row['tokens_per_request']} tokens, not {want}")  # fmt: skip
    for chat in report["chat"]["conversations"]:
        for turn in chat["turns"][1:]:
            if turn["cached_tokens"] <= 0:
                found.append(f"chat {chat['adapter'] or 'base'} turn {turn['turn']}: nothing "
                             "of its earlier turns was cached")  # fmt: skip
    cross = report["chat"]["cross_check"]
    for row in cross[:-1]:
        if row["cached_tokens"] != 0:
            found.append(f"{row['adapter'] or 'the base model'} given {row['prompt_of']}'s "
                         f"prompt found {row['cached_tokens']} tokens cached (must be 0)")  # fmt: skip
    if cross[-1]["cached_tokens"] <= 0:
        found.append(f"{cross[-1]['adapter']} found none of its own prompt cached")
    divergence = report["divergence"]["adapters"]
    if divergence and all(row["first_different_token"] is None for row in divergence):
        found.append("every adapter's answer to the open prompt is the base model's: are the "
                     "adapters applied?")  # fmt: skip
    swaps = report["swap"]["requests"]
    for kind, copies in (("first_use", 1), ("resident", 0), ("returning", 1), ("base", 0)):
        bad = [r["copies"] for r in swaps[kind] if r["copies"] != copies]
        if bad:
            found.append(f"swap {kind}: steps copied {bad} adapters into slots, not {copies}")
    return found


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _throughput_lines(report: dict[str, Any]) -> list[str]:
    t = report["throughput"]
    lines = [f"decode, {t['batch']} requests x {t['decode_tokens']} tokens (greedy), "
             f"{len(t['order'])} repeat(s), order per repeat {t['order']}:", "",
             "| adapters | decode tok/s | x base | per repeat tok/s | x base per repeat | "
             "ITL mean ms | ITL p50 ms | ITL p90 ms | TTFT mean ms | native steps |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in t["variants"]:
        repeats = " / ".join(_num(v, ".0f") for v in row["per_repeat_tokens_per_s"])
        paired = " / ".join(_num(v, ".2f") for v in row["per_repeat_vs_base"])
        itl = row["itl_ms"]
        lines.append(f"| {row['adapters']} | {_num(row['decode_tokens_per_s'], '.1f')} | "
                     f"{_num(row['tokens_per_s_vs_base'], '.2f')} | {repeats} | {paired} | "
                     f"{_num(itl['mean'], '.2f')} | {_num(itl['p50'], '.2f')} | "
                     f"{_num(itl['p90'], '.2f')} | {_num(row['ttft_ms_mean'], '.1f')} | "
                     f"{row['native_steps']}/{row['steps']} |")  # fmt: skip
    four = next((r for r in t["variants"] if r["adapters"] == 4), None)
    if four is not None and four["tokens_per_s_vs_base"] is not None:
        ratio = four["tokens_per_s_vs_base"]
        verdict = "meets" if ratio >= TARGET_RATIO else "BELOW"
        lines += ["", f"4 adapters: {ratio:.2f}x the base model's decode tokens/s ({verdict} "
                  f"the {TARGET_RATIO}x target; median of the repeats' ratios "
                  f"{_num(four['median_repeat_vs_base'], '.2f')})"]  # fmt: skip
    return lines


def _chat_lines(report: dict[str, Any]) -> list[str]:
    lines = ["", "chat turns, one request at a time (TTFT ms / cached of prompt tokens):", "",
             "| adapter | " + " | ".join(f"turn {t['turn']}" for t in
                                      report["chat"]["conversations"][0]["turns"]) + " |"]  # fmt: skip
    lines.append("|---|" + "---|" * len(report["chat"]["conversations"][0]["turns"]))
    for chat in report["chat"]["conversations"]:
        cells = [f"{_num(t['ttft_ms'], '.1f')} / {t['cached_tokens']} of {t['prompt_tokens']}"
                 for t in chat["turns"]]  # fmt: skip
        lines.append(f"| {chat['adapter'] or 'base'} | " + " | ".join(cells) + " |")
    d = report["divergence"]
    departs = ", ".join(f"{r['adapter']} at token {r['first_different_token']}"
                        if r["first_different_token"] is not None else f"{r['adapter']} never"
                        for r in d["adapters"])  # fmt: skip
    lines += ["", f"answers to {d['prompt']!r} ({d['tokens']} tokens) depart from the base "
              f"model's: {departs}"]  # fmt: skip
    lines += ["", "cross-check, the first adapter's next prompt:", ""]
    for row in report["chat"]["cross_check"]:
        lines.append(f"- {row['adapter'] or 'base'}: {row['cached_tokens']} of "
                     f"{row['prompt_tokens']} cached, TTFT {_num(row['ttft_ms'], '.1f')} ms")  # fmt: skip
    return lines


def _swap_lines(report: dict[str, Any]) -> list[str]:
    s = report["swap"]
    m = s["median_ms"]
    return ["", f"swap-in, {s['slots']} slots, {s['adapters_loaded']} adapters loaded "
            f"({report['adapters']['size_bytes'] / (1 << 20):.1f} MiB each on the host), "
            f"medians of {len(s['load_ms'])}; a step: a one-token request of "
            f"{s['prompt_tokens']} prompt tokens alone:", "",
            "| load_lora (disk → host) | copy into a slot | first step: first use | "
            "back after eviction | adapter resident | base model |", "|---|---|---|---|---|---|",
            f"| {m['load']:.1f} ms | {m['copy_in']:.1f} ms | {m['first_use_step']:.1f} ms | "
            f"{m['returning_step']:.1f} ms | {m['resident_step']:.1f} ms | "
            f"{m['base_step']:.1f} ms |"]  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    env, eng = report["environment"], report["engine"]
    head = (f"LoRA adapters, {env['date_utc']}, {env['host']} ({env['cpu_count']} cores), load "
            f"average {' '.join(f'{x:.2f}' for x in env['load_average'])} at start; "
            f"{eng['model']} {eng['dtype']} on {eng['device']}, max_loras {eng['max_loras']}, "
            f"max_lora_rank {eng['max_lora_rank']}, adapters r={report['adapters']['rank']} "
            "on q,k,v,o,gate,up,down")  # fmt: skip
    lines = [head, "", *_throughput_lines(report), *_chat_lines(report), *_swap_lines(report)]
    lines += ["", f"checks failed: {len(report['problems'])}"
              + ("  <-- ERROR" if report["problems"] else "")]  # fmt: skip
    return "\n".join(lines)


def plot_path(out_path: Path) -> Path:
    return out_path.with_name(f"{out_path.stem}-tokens-per-s.png")


def write_plot(report: dict[str, Any], path: Path) -> Path | None:
    """Decode tokens/s against distinct adapters in the batch; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["throughput"]["variants"]
    labels = [str(r["adapters"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(labels, [r["decode_tokens_per_s"] or 0 for r in rows])
    base = rows[0]["decode_tokens_per_s"] if rows and rows[0]["adapters"] == 0 else None
    if base:
        ax.axhline(base * TARGET_RATIO, color="grey", linestyle="--",
                   label=f"{TARGET_RATIO}x the base model")  # fmt: skip
        ax.legend(fontsize=8)
    ax.set_xlabel("distinct adapters in the batch (0: the base model)")
    ax.set_ylabel("decode tokens/s")
    t = report["throughput"]
    ax.set_title(f"{t['batch']} requests x {t['decode_tokens']} tokens, "
                 f"{report['environment']['date_utc']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(report: dict[str, Any], out_path: Path) -> None:
    """The checks, the plot beside the JSON, the JSON, the table on stdout."""
    report["problems"] = problems(report)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    plot = write_plot(report, plot_path(out_path))
    report["plot"] = None if plot is None else str(plot)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"lora: wrote {out_path}" + (f" and {plot}" if plot else ""), file=sys.stderr)
