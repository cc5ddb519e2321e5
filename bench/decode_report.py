"""`--scenario decode`'s results: per cell and server the ITL figures, the floor and the
batch's tokens/s (`cell_stats`), the JSON document, the table and the plot of ITL
against batch size per context."""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.bench.memory_floor import floor_ms

if TYPE_CHECKING:
    from radixserve.bench.decode_cells import Cell, CellRun, DecodeOptions, Outcome, Served, System

WINDOW_ALL = "every stream decoding"
WINDOW_NONE = "every gap (the streams never all decoded at once)"


def stream_times(sent: float, ttft_ms: float, gaps_ms: Sequence[float]) -> list[float]:
    """When each content chunk of a stream arrived (perf_counter seconds)."""
    times = [sent + ttft_ms / 1e3]
    for gap in gaps_ms:
        times.append(times[-1] + gap / 1e3)
    return times


def steady_gaps(times: Sequence[Sequence[float]]) -> tuple[list[list[float]], str]:
    """Per stream its gaps (ms) while every stream decodes: from the last stream's first
    chunk to the first stream's last. If a stream has none there (they never overlapped),
    every gap after each stream's first chunk; and which of the two it is."""
    lo, hi = max(t[0] for t in times), min(t[-1] for t in times)
    windowed = [[(b - a) * 1e3 for a, b in zip(t, t[1:]) if a >= lo and b <= hi] for t in times]
    if all(windowed):
        return windowed, WINDOW_ALL
    return [[(b - a) * 1e3 for a, b in zip(t, t[1:])] for t in times], WINDOW_NONE


def cell_stats(run: CellRun, cell: Cell, served: Served, gbs: float) -> dict[str, Any]:
    """The figures of one measured cell; ValueError if a stream sent fewer than two
    content chunks (no gap to measure)."""
    samples = [s for _, s in run.streams]
    times = [stream_times(sent, s.ttft_ms, s.itl_ms) for sent, s in run.streams]
    if any(len(t) < 2 for t in times):
        raise ValueError("a stream sent fewer than two content chunks: no inter-token gap")
    gaps, window = steady_gaps(times)
    pooled = [g for stream in gaps for g in stream]
    per_stream = [statistics.mean(stream) for stream in gaps]
    tokens = sum(s.completion_tokens for s in samples)
    wall_s = max(t[-1] for t in times) - min(sent for sent, _ in run.streams)
    mean_context = cell.prompt_tokens + cell.decode_tokens / 2
    kv_bytes = cell.batch * mean_context * served.kv_bytes_per_token
    floor = floor_ms(served.weight_bytes, kv_bytes, gbs)
    p50 = statistics.median(pooled)
    return {
        "itl_ms": {
            "p50": p50,
            "p90": _quantile(pooled, 0.9),
            "mean": statistics.mean(per_stream),
            "per_stream_mean": per_stream,
        },  # fmt: skip
        "gaps_counted": len(pooled),
        "window": window,
        "ttft_ms": {
            "mean": statistics.mean(s.ttft_ms for s in samples),
            "max": max(s.ttft_ms for s in samples),
        },  # fmt: skip
        "tokens_per_s": tokens / wall_s,
        "wall_s": wall_s,
        "completion_tokens": [s.completion_tokens for s in samples],
        "chunks": [len(t) for t in times],
        "prompt_tokens": [s.prompt_tokens for s in samples],
        "cached_tokens": [s.cached_tokens for s in samples],
        "usage_reported": all(s.usage_reported for s in samples),
        "primed_prompt_tokens": [s.prompt_tokens for s in run.primed],
        "mean_context": mean_context,
        "kv_read_bytes": kv_bytes,
        "floor_ms": floor,
        "itl_p50_over_floor": p50 / floor,
        "itl_mean_over_floor": statistics.mean(per_stream) / floor,
    }


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def new_document(options: DecodeOptions, cells_run: Sequence[Cell], model_path: Path,
                 systems: Sequence[System], not_run: dict[str, str],
                 gbs: float) -> dict[str, Any]:  # fmt: skip
    """The JSON document before any cell ran: every cell of ``cells_run`` lists every
    server, pending (or skipped, for a server not run)."""
    from radixserve.bench.peer_servers import LLAMA_SERVER, llama_server_build_commands
    from radixserve.bench.suite import machine_info

    names = [s.name for s in systems] + list(not_run)
    cells = []
    for cell in cells_run:
        entry = {name: {"status": "pending"} for name in names}
        for name, why in not_run.items():
            entry[name] = {"status": "skipped", "reason": f"{name} not run: {why}"}
        cells.append({"batch": cell.batch, "context": cell.context,
                      "prompt_tokens": cell.prompt_tokens, "decode_tokens": cell.decode_tokens,
                      "servers": entry, "ratio_itl_mean": None})  # fmt: skip
    build = llama_server_build_commands(Path("/path/to/llama"))
    return {
        "scenario": "decode",
        "date": datetime.date.today().isoformat(),
        "machine": machine_info(),
        "model": {"checkpoint": options.model, "path": str(model_path)},
        "settings": {
            "batches": list(options.batches),
            "contexts": list(options.contexts),
            "decode_tokens": options.decode_tokens,
            "prefill_budget_tokens": options.prefill_budget_tokens,
            "seed": options.seed,
            "engine_env": options.engine_env,
            "llama_server_threads": options.threads,
            "peer_env": options.peer_env,
            "temperature": 0.0,
        },
        "copy_gbs": gbs,
        "servers": {
            s.name: {"served": dataclasses.asdict(s.served), "deployments": []} for s in systems
        },  # fmt: skip
        "not_run": not_run,
        "llama_server_build": build if LLAMA_SERVER in not_run else None,
        "cells": cells,
        "plot": None,
    }


def add_outcome(doc: dict[str, Any], system: System, cell: Cell, outcome: Outcome,
                deployment: dict[str, Any]) -> None:  # fmt: skip
    """Record one cell's outcome on one server (and the deployment it ran on)."""
    row = next(c for c in doc["cells"] if (c["batch"], c["context"]) == (cell.batch, cell.context))
    entry: dict[str, Any] = {"status": outcome.status}
    if outcome.run is not None:
        try:
            entry.update(cell_stats(outcome.run, cell, system.served, doc["copy_gbs"]))
        except ValueError as exc:
            entry = {"status": "failed", "reason": str(exc)}
    else:
        entry["reason"] = outcome.reason
    row["servers"][system.name] = entry
    deployments = doc["servers"][system.name]["deployments"]
    if deployment and deployment not in deployments:
        deployments.append(deployment)
    measured = [row["servers"].get(n, {}) for n in ("radixserve", "llama-server")]
    if all(m.get("status") == "measured" for m in measured):
        row["ratio_itl_mean"] = measured[0]["itl_ms"]["mean"] / measured[1]["itl_ms"]["mean"]


def write_json(doc: dict[str, Any], out_path: Path) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2) + "\n")


def finish(doc: dict[str, Any], out_path: Path) -> None:
    """The plot beside the JSON (if any cell was measured), the JSON, the table."""
    if any(e["status"] == "measured" for c in doc["cells"] for e in c["servers"].values()):
        doc["plot"] = str(write_plot(doc, plot_path(out_path)))
    write_json(doc, out_path)
    print(markdown(doc))
    print(f"decode: wrote {out_path}" + (f" and {doc['plot']}" if doc["plot"] else ""),
          file=sys.stderr)  # fmt: skip


def _pair(values: Sequence[str]) -> str:
    return " / ".join(values)


def markdown(doc: dict[str, Any]) -> str:
    """One row per cell; the reasons of skipped and failed cells below."""
    names = list(doc["cells"][0]["servers"]) if doc["cells"] else []
    both = _pair(names)
    head = ["B", "C"] + [f"{n} ITL p50 / mean (ms)" for n in names]
    head += [f"{names[0]} ÷ {names[1]} (ITL mean)"] if len(names) == 2 else []
    head += [f"floor ms ({both})", f"ITL mean ÷ floor ({both})", f"batch tok/s ({both})"]
    lines = [
        f"decode ITL, {doc['model']['checkpoint']} ({Path(doc['model']['path']).name}), "
        f"{doc['settings']['decode_tokens']} tokens per stream, copy bandwidth "
        f"{doc['copy_gbs']:.1f} GB/s (read + write)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    notes = []
    for row in doc["cells"]:
        entries = [row["servers"][n] for n in names]
        cells = [str(row["batch"]), str(row["context"])]
        for name, e in zip(names, entries):
            if e["status"] == "measured":
                cells.append(f"{e['itl_ms']['p50']:.2f} / {e['itl_ms']['mean']:.2f}")
            else:
                cells.append(e["status"])
                notes.append(f"- B={row['batch']} C={row['context']}, {name}: {e.get('reason')}")
        if len(names) == 2:
            ratio = row["ratio_itl_mean"]
            cells.append(f"{ratio:.2f}x" if ratio is not None else "—")
        for key, fmt in (("floor_ms", "{:.2f}"), ("itl_mean_over_floor", "{:.1f}x"),
                         ("tokens_per_s", "{:.0f}")):  # fmt: skip
            cells.append(_pair([fmt.format(e[key]) if e["status"] == "measured" else "—"
                                for e in entries]))  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "Not measured:", *notes]
    return "\n".join(lines)


def plot_path(out_path: Path) -> Path:
    return out_path.with_name(f"{out_path.stem}-itl.png")


def write_plot(doc: dict[str, Any], path: Path) -> Path:
    """Mean ITL against batch size, one panel per context, each server with its floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = doc["settings"]["contexts"]
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.5 * len(contexts), 4), squeeze=False)
    names = list(doc["servers"])
    for ax, context in zip(axes[0], contexts):
        rows = [c for c in doc["cells"] if c["context"] == context]
        for i, name in enumerate(names):
            got = [(c["batch"], c["servers"][name]) for c in rows
                   if c["servers"][name]["status"] == "measured"]  # fmt: skip
            if not got:
                continue
            color = f"C{i}"
            batches = [b for b, _ in got]
            ax.plot(batches, [e["itl_ms"]["mean"] for _, e in got], "o-", color=color,
                    label=f"{name} ITL mean")  # fmt: skip
            ax.plot(batches, [e["floor_ms"] for _, e in got], "--", color=color,
                    label=f"{name} floor")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(doc["settings"]["batches"], [str(b) for b in doc["settings"]["batches"]])
        ax.set_xlabel("concurrent streams (B)")
        ax.set_ylabel("ms per token")
        ax.set_title(f"context {context}", fontsize=10)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
    fig.suptitle(f"decode ITL, {doc['model']['checkpoint']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
