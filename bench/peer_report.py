"""The peer benchmark's numbers: per-run statistics, the JSON document, the tables.

Per server and mode, for each workload: TTFT p50 / p90 (and mean), ITL p50 / p90,
requests/s and output tokens/s over the workload's wall time, errors (failed requests
are counted, never measured), mean prompt and cached tokens as the server reported
them. The multi-turn chat also per round, and its summary figures: the mean TTFT of
rounds 2..R (the cached turns) and of round 1, and a 64-token cached turn end to end
(that mean TTFT + 63 × the chat's ITL p50). The comparisons are ratios radixserve ÷
llama.cpp from the same run.

radixserve's cached turns (cache on) also against their compute floor
(`compute_floor.py`): each turn's delta (prompt − cached tokens, as the server reported
them) over its cached tokens, at the rates measured in the bench process before the
first server started.
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.bench.report import Sample, ScenarioRun, percentile

if TYPE_CHECKING:
    from radixserve.bench.compute_floor import ComputeFloor
    from radixserve.bench.peer_options import PeerOptions, TargetRun
    from radixserve.bench.peer_servers import PeerConfig


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def sample_stats(samples: Sequence[Sample]) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None]
    counted = [s for s in ok if s.usage_reported]  # llama-cpp-python streams no usage
    ttft = [s.ttft_ms for s in ok]
    itl = [gap for s in ok for gap in s.itl_ms]
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "ttft_ms": {"mean": _mean(ttft), "p50": percentile(ttft, 50), "p90": percentile(ttft, 90)},
        "itl_ms": {"mean": _mean(itl), "p50": percentile(itl, 50), "p90": percentile(itl, 90)},
        "prompt_tokens_mean": _mean([s.prompt_tokens for s in counted]),
        "cached_tokens_mean": _mean([s.cached_tokens for s in counted]),
        "output_tokens": sum(s.completion_tokens for s in ok),
        "error_examples": sorted({s.error for s in samples if s.error})[:3],
    }


def run_stats(run: ScenarioRun) -> dict[str, Any]:
    stats = sample_stats(run.samples)
    ok = stats["requests"] - stats["errors"]
    return {
        **stats,
        "wall_s": run.wall_s,
        "requests_per_s": ok / run.wall_s,
        "output_tokens_per_s": stats["output_tokens"] / run.wall_s,
    }


TURN_TOKENS = 64  # the answer of the cached turn timed end to end


def turn_ms(cached_ttft_ms: float | None, itl_p50_ms: float | None) -> float | None:
    """A cached turn of `TURN_TOKENS` output tokens end to end: its first token, then
    the other 63 at the ITL p50."""
    if cached_ttft_ms is None or itl_p50_ms is None:
        return None
    return cached_ttft_ms + (TURN_TOKENS - 1) * itl_p50_ms


def multi_turn_stats(run: ScenarioRun) -> dict[str, Any]:
    """`run_stats` plus per round, the cached-turn / round-1 means and a 64-token cached
    turn end to end."""
    rounds = sorted({s.round for s in run.samples})
    per_round = [
        {"round": r, **sample_stats([s for s in run.samples if s.round == r])} for r in rounds
    ]
    later = [row["ttft_ms"]["mean"] for row in per_round[1:] if row["ttft_ms"]["mean"] is not None]
    first = run.samples[0] if run.samples else None
    stats = run_stats(run)
    return {
        **stats,
        "rounds": per_round,
        "cached_turn_ttft_ms": _mean(later),  # mean over rounds 2..R of each round's mean
        "cached_turn_64_tokens_ms": turn_ms(_mean(later), stats["itl_ms"]["p50"]),
        "round1_ttft_ms": per_round[0]["ttft_ms"]["mean"] if per_round else None,
        "first_request_ttft_ms": first.ttft_ms if first and first.error is None else None,
    }


def _run_doc(run: TargetRun) -> dict[str, Any]:
    t = run.target
    return {
        "server": t.server,
        "mode": t.mode,
        "busting": t.busting or None,
        "request_fields": t.extra_body,
        "unique_prefix": t.unique_prefix,
        "model_id": run.model_id,
        "settings": run.settings,
        "multi_turn": multi_turn_stats(run.multi_turn),
        "load": run_stats(run.load),
    }


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def comparisons(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """radixserve ÷ the better llama.cpp server, cache on, for the issue's targets."""
    on = {r["server"]: r for r in runs if r["mode"] == "on"}
    ours = on.get("radixserve")
    peers = [r for name, r in on.items() if name != "radixserve"]
    rows = []

    def add(
        what: str, key: Any, target: str, among: list[dict[str, Any]], best_of: Any = min
    ) -> None:
        values = [(key(p), p["server"]) for p in among if key(p) is not None]
        best = best_of(values) if values else (None, None)
        mine = key(ours) if ours else None
        rows.append(
            {
                "what": what,
                "radixserve": mine,
                "peer": best[1],
                "peer_value": best[0],
                "ratio": _ratio(mine, best[0]),
                "target": target,
            }
        )

    add(
        "multi-turn: mean TTFT of the cached turns (rounds 2..R), ms",
        lambda r: r["multi_turn"]["cached_turn_ttft_ms"],
        "≤ 1×",
        peers,
    )
    add(
        "multi-turn: round-1 TTFT (mean), ms",
        lambda r: r["multi_turn"]["round1_ttft_ms"],
        "≤ 0.5×",
        peers,
    )
    native = [p for p in peers if p["server"] == "llama-server"]
    add(
        f"multi-turn: a {TURN_TOKENS}-token cached turn end to end (2..R TTFT mean + "
        f"{TURN_TOKENS - 1} × ITL p50), ms",
        lambda r: r["multi_turn"]["cached_turn_64_tokens_ms"],
        "≤ 0.8×",
        native,
    )
    add("load: TTFT p50, ms", lambda r: r["load"]["ttft_ms"]["p50"], "< 1×", native)
    add("load: TTFT p90, ms", lambda r: r["load"]["ttft_ms"]["p90"], "< 1×", native)
    add("load: errors", lambda r: r["load"]["errors"], "0", native)
    add("load: ITL p50, ms", lambda r: r["load"]["itl_ms"]["p50"], "≤ 1×", native)
    add("load: requests/s", lambda r: r["load"]["requests_per_s"], "≥ 1×", native, max)
    return rows


def weights_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """radixserve with its default (quantized) weights ÷ the same with quantization=none."""
    mine = {r["mode"]: r for r in runs if r["server"] == "radixserve"}
    quantized, dense = mine.get("on"), mine.get("on, weights none")
    if quantized is None or dense is None:
        return []
    keys = {
        "multi-turn: cached-turn TTFT, ms": lambda r: r["multi_turn"]["cached_turn_ttft_ms"],
        "multi-turn: round-1 TTFT, ms": lambda r: r["multi_turn"]["round1_ttft_ms"],
        "load: ITL p50, ms": lambda r: r["load"]["itl_ms"]["p50"],
        "load: ITL p90, ms": lambda r: r["load"]["itl_ms"]["p90"],
        "load: TTFT p50, ms": lambda r: r["load"]["ttft_ms"]["p50"],
        "load: requests/s": lambda r: r["load"]["requests_per_s"],
    }
    return [
        {
            "what": what,
            "radixserve": key(quantized),
            "peer": "radixserve, weights none",
            "peer_value": key(dense),
            "ratio": _ratio(key(quantized), key(dense)),
            "target": "cached TTFT ≤ 1×" if "cached" in what else "",
        }
        for what, key in keys.items()
    ]


FLOOR_DEFINITION = (
    "per cached turn (rounds 2..R), its delta R = prompt - cached tokens over its cached "
    "tokens P: 2 x R x layer_params + 2 x vocab x hidden GEMM FLOPs at the GEMM rate on R "
    "rows, plus R x (P + (R+1)/2) x heads x head_dim x 4 x layers attention FLOPs at the "
    "native attention's rate on R rows over P (rates interpolated between those measured)"
)


def cached_turn_floor(samples: Sequence[Sample], floor: ComputeFloor) -> dict[str, Any] | None:
    """The cached turns (rounds 2..R, answered, with usage) against their compute floors:
    the means and the ratio of the means."""
    turns = []
    for s in samples:
        if s.round < 2 or s.error is not None or not s.usage_reported:
            continue
        delta = max(s.prompt_tokens - s.cached_tokens, 1)  # the last prompt token always runs
        prefix_len = s.prompt_tokens - delta
        turns.append({"round": s.round, "prompt_tokens": s.prompt_tokens,
                      "cached_tokens": s.cached_tokens, "delta_tokens": delta,
                      "ttft_ms": s.ttft_ms, "floor_ms": floor.floor_ms(delta, prefix_len)})  # fmt: skip
    if not turns:
        return None
    ttft, floor_ms = _mean([t["ttft_ms"] for t in turns]), _mean([t["floor_ms"] for t in turns])
    return {
        "turns": len(turns),
        "delta_tokens_mean": _mean([t["delta_tokens"] for t in turns]),
        "prompt_tokens_mean": _mean([t["prompt_tokens"] for t in turns]),
        "ttft_ms_mean": ttft,
        "floor_ms_mean": floor_ms,
        "ttft_over_floor": _ratio(ttft, floor_ms),
        "per_turn": turns,
    }


def floor_section(
    runs: list[TargetRun], floor: tuple[ComputeFloor, dict[str, Any]] | None
) -> dict[str, Any] | None:
    """The rates, how they were measured, and radixserve's cache-on turns against them."""
    if floor is None:
        return None
    compute, measured = floor
    mine = [r for r in runs if r.target.server == "radixserve" and r.target.mode == "on"]
    turns = cached_turn_floor(mine[0].multi_turn.samples, compute) if mine else None
    return {
        "definition": FLOOR_DEFINITION,
        "measured": measured,
        "shape": asdict(compute.shape),
        "rates": compute.rates.to_json(),
        "radixserve_cached_turns": turns,
    }


def build_result(
    options: PeerOptions,
    runs: list[TargetRun],
    skipped: dict[str, str],
    peers: list[PeerConfig],
    model_path: Path,
    expected_prompt_tokens: int,
    floor: tuple[ComputeFloor, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    from radixserve.bench.peer_servers import install_commands, llama_server_build_commands
    from radixserve.bench.suite import machine_info

    docs = [_run_doc(r) for r in runs]
    first_prompt = {f"{r.target.server} ({r.target.mode})": r.template_prompt_tokens
                    for r in runs}  # fmt: skip
    p = options.preset
    venv = options.settings.peer_venv
    return {
        "scenario": "peer",
        "preset": options.preset_name,
        "date": datetime.date.today().isoformat(),
        "machine": machine_info(),
        "model": {"path": str(model_path), "checkpoint": options.model},
        "settings": {
            "threads": options.threads,
            "llama_server_slots": options.slots,
            "multi_turn": _plain(vars(p.multi_turn)),
            "load": _plain(vars(p.load)),
            "temperature": 0.0,
            "seed": options.seed,
            "peer_venv": str(venv) if venv else None,
            "peer_env": options.peer_env,
            "peer_commands": {c.name: list(c.argv) for c in peers},
        },
        "skipped": skipped,
        "install": install_commands(venv or Path("/path/to/peer-venv")) if skipped else None,
        "llama_server_build": llama_server_build_commands(Path("/path/to/llama"))
        if "llama-server" in skipped
        else None,
        "prompt_tokens_round1": {"local_template": expected_prompt_tokens, **first_prompt},
        "runs": docs,
        "comparisons": comparisons(docs),
        "weights": weights_rows(docs),
        "compute_floor": floor_section(runs, floor),
    }


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _f(value: float | None, spec: str = ".0f") -> str:
    return "—" if value is None else f"{value:{spec}}"


def _pair(d: dict[str, Any], a: str = "p50", b: str = "p90") -> str:
    return f"{_f(d[a])} / {_f(d[b])}"


def side_by_side(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| workload | server | cache | TTFT p50 / p90 (ms) | ITL p50 / p90 (ms) | req/s | "
        "output tok/s | errors | prompt tok (mean) | cached tok (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in ("multi_turn", "load"):
        for r in doc["runs"]:
            s = r[workload]
            lines.append(
                f"| {workload.replace('_', '-')} | {r['server']} | {r['mode']} | "
                f"{_pair(s['ttft_ms'])} | {_pair(s['itl_ms'])} | {s['requests_per_s']:.2f} | "
                f"{s['output_tokens_per_s']:.1f} | {s['errors']} / {s['requests']} | "
                f"{_f(s['prompt_tokens_mean'])} | {_f(s['cached_tokens_mean'])} |"
            )
    return lines


def per_round(doc: dict[str, Any]) -> list[str]:
    runs = doc["runs"]
    names = [f"{r['server']} {r['mode']}" for r in runs]
    lines = [
        "| round | " + " | ".join(f"{n}: TTFT ms (prompt / cached tok)" for n in names) + " |",
        "|---|" + "---|" * len(runs),
    ]
    num_rounds = max((len(r["multi_turn"]["rounds"]) for r in runs), default=0)
    for i in range(num_rounds):
        cells = []
        for r in runs:
            rows = r["multi_turn"]["rounds"]
            row = rows[i] if i < len(rows) else None
            cells.append(
                "—"
                if row is None
                else f"{_f(row['ttft_ms']['mean'])} "
                f"({_f(row['prompt_tokens_mean'])} / {_f(row['cached_tokens_mean'])})"
            )
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines.append(
        "| **2..R mean** | "
        + " | ".join(_f(r["multi_turn"]["cached_turn_ttft_ms"]) for r in runs)
        + " |"
    )
    lines.append(
        f"| **a {TURN_TOKENS}-token cached turn** (2..R mean + {TURN_TOKENS - 1} × ITL p50) | "
        + " | ".join(_f(r["multi_turn"].get("cached_turn_64_tokens_ms")) for r in runs)
        + " |"
    )
    return lines


def floor_table(doc: dict[str, Any]) -> list[str]:
    """radixserve's cached turns against their compute floor, and the rates measured."""
    section = doc.get("compute_floor")
    if not section:
        return []
    m, rates, turns = section["measured"], section["rates"], section["radixserve_cached_turns"]
    lines = [
        f"compute floor of a cached turn: its delta's GEMM FLOPs at the layer matrices' rate "
        f"on its rows + its attention FLOPs at the native attention's rate over its cached "
        f"tokens; rates measured in the bench process with no server running "
        f"({m['torch_threads']} torch threads, {m['dtype']}, {m['seconds']:.0f} s)",
        "",
        "| radixserve, cache on | cached turns | delta tok (mean) | context tok (mean) | "
        "TTFT mean, ms | floor mean, ms | TTFT / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    if turns is None:
        lines.append("| rounds 2..R | — | — | — | — | — | — |")
    else:
        lines.append(
            f"| rounds 2..R | {turns['turns']} | {_f(turns['delta_tokens_mean'])} | "
            f"{_f(turns['prompt_tokens_mean'])} | {_f(turns['ttft_ms_mean'])} | "
            f"{_f(turns['floor_ms_mean'])} | {_f(turns['ttft_over_floor'], '.2f')}× |"
        )
    lines += [
        "",
        "| GFLOP/s | " + " | ".join(f"{r} rows" for r in rates["rows"]) + " |",
        "|---|" + "---|" * len(rates["rows"]),
        "| GEMM | " + " | ".join(_f(g) for g in rates["gemm_gflops"]) + " |",
    ]
    for prefix_len, row in zip(rates["prefix_lens"], rates["attention_gflops"]):
        lines.append(
            f"| attention over {prefix_len} cached tokens | "
            + " | ".join(_f(a) for a in row)
            + " |"
        )
    return lines


def comparison_table(
    doc: dict[str, Any], key: str = "comparisons",
    title: str = "radixserve vs the better llama.cpp (cache on)", other: str = "llama.cpp",
) -> list[str]:  # fmt: skip
    lines = [f"| {title} | radixserve | {other} | ratio | target |", "|---|---|---|---|---|"]
    for c in doc.get(key, []):
        spec = "d" if "errors" in c["what"] else ".2f" if "/s" in c["what"] else ".0f"
        peer = "—" if c["peer"] is None else f"{_f(c['peer_value'], spec)} ({c['peer']})"
        lines.append(
            f"| {c['what']} | {_f(c['radixserve'], spec)} | {peer} | "
            f"{_f(c['ratio'], '.2f')}{'×' if c['ratio'] is not None else ''} | "
            f"{c['target']} |"
        )
    return lines


def markdown(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    mt, load = s["multi_turn"], s["load"]
    lines = [
        f"### peer ({doc['preset']}), {doc['date']}: {doc['machine']['cpu']}, "
        f"{doc['machine']['cores']} cores, {s['threads']} threads per server",
        "",
        f"multi-turn: {mt['conversations']} conversation(s) × {mt['rounds']} rounds, one at a "
        f"time, system prompt ~{mt['system_tokens']} tokens, answers {mt['answer_tokens'][0]}–"
        f"{mt['answer_tokens'][1]} tokens; load: {load['users']} requests, {load['concurrency']} "
        f"at once, shared prefix ~{load['doc_tokens_total']} tokens, questions "
        f"{load['question_tokens'][0]} tokens, {load['answer_tokens'][0]} output tokens",
        "",
        *[f"- {r['server']} ({r['mode']}): {_describe(r)}" for r in doc["runs"]],
        *[f"- {name}: skipped, not measured ({why})" for name, why in doc["skipped"].items()],
        *[f"- {name}: not measured ({why})" for name, why in doc.get("not_measured", {}).items()],
        "- prompt tokens of round 1's messages as each server counts them (local template "
        "first): " + ", ".join(f"{k} {_f(v)}" for k, v in doc["prompt_tokens_round1"].items()),
        "",
        *side_by_side(doc),
        "",
        *per_round(doc),
        "",
        *comparison_table(doc),
    ]
    if doc.get("compute_floor"):
        lines += ["", *floor_table(doc)]
    if doc.get("weights"):
        lines += ["", *comparison_table(doc, "weights", "radixserve: default weights vs "
                                        "quantization=none (cache on)", "weights none")]  # fmt: skip
    return "\n".join(lines)


def _describe(run: dict[str, Any]) -> str:
    st = run["settings"]
    if "processes" in st:  # a cluster
        what = (
            f"{st['command']}: {', '.join(st['processes'])}; {st['transport']}; "
            f"{st['threads']}; {st['device']} {st['dtype']}, weights "
            f"{st.get('quantization', 'auto')}; KV {st['kv_cache_memory_gib']} "
            f"GiB, pages of {st['page_size']}"
        )
    else:
        env = " ".join(f"{k}={v}" for k, v in st.get("env", {}).items() if k != "LD_LIBRARY_PATH")
        what = (env + " " if env else "") + st["command"]
        what += f" + {st['fallback']}" if "fallback" in st else ""
    fields = json.dumps(run["request_fields"])
    busted = f"; busted by {run['busting']}" if run["busting"] else ""
    return f"{what}; request fields {fields}{busted}"


def write_json(doc: dict[str, Any], out_path: Path) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2) + "\n")


def write(doc: dict[str, Any], out_path: Path) -> None:
    """The JSON, and the tables on stdout."""
    write_json(doc, out_path)
    print(markdown(doc))
    print(f"peer: wrote {out_path}", file=sys.stderr)
