"""`--scenario speculative --through-cluster`: batch-1 code-edit and RAG through
`radixserve up` (one cluster per method: off, then both), streamed over HTTP. ITL from
the stream's chunks; acceptance and tokens per verification from the gateway's /metrics
(the workers' ``radixserve_worker_speculative_<method>_<what>_total``); the answers'
text compared with off's."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from radixserve.bench.speculative_workloads import build_workload

if TYPE_CHECKING:
    from radixserve.bench.speculative_options import SpeculativeOptions

CLUSTER_METHODS = ("off", "both")
CLUSTER_WORKLOADS = ("code-edit", "rag")
_WHATS = ("steps", "drafted", "accepted", "emitted")


def stream_chat(http: httpx.Client, model: str, messages: list[dict[str, str]],
                max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """One greedy streamed chat completion: its text, chunk times and usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    times: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(
                f"/v1/chat/completions answered {resp.status_code}: {resp.text[:300]}"
            )
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream failed: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    times.append(time.perf_counter())
                    text.append(content)
    return {"text": "".join(text), "times": times,
            "completion_tokens": usage.get("completion_tokens", len(times))}  # fmt: skip


def speculation_counters(metrics_text: str) -> dict[str, float]:
    """The workers' speculation counters on the gateway's /metrics, summed over methods."""
    from radixserve.bench.local_cluster import metric_value

    return {what: sum(metric_value(metrics_text, f"radixserve_worker_speculative_{m}_{what}_total")
                      for m in ("prompt", "radix")) for what in _WHATS}  # fmt: skip


def _figures(streams: list[dict[str, Any]], moved: dict[str, float]) -> dict[str, Any]:
    means, gaps = [], []
    for s in streams:
        t, n = s["times"], s["completion_tokens"]
        if len(t) > 1 and n > 1:
            means.append((t[-1] - t[0]) * 1e3 / (n - 1))
            gaps += [(b - a) * 1e3 for a, b in zip(t, t[1:])]
    return {
        "itl_ms": {
            "mean": statistics.mean(means) if means else None,
            "p50_chunk": statistics.median(gaps) if gaps else None,
        },  # fmt: skip
        "completion_tokens": [s["completion_tokens"] for s in streams],
        "counters": moved,
        "acceptance": moved["accepted"] / moved["drafted"] if moved["drafted"] else None,
        "tokens_per_verification": moved["emitted"] / moved["steps"] if moved["steps"] else None,
    }


def run_cluster_cells(options: SpeculativeOptions,
                      progress: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """The cluster's rows, and any answer that differs from off's."""
    from radixserve.bench.local_cluster import LocalCluster
    from radixserve.launch.cluster import ClusterConfig

    cells: list[dict[str, Any]] = []
    texts: dict[tuple[str, str], list[str]] = {}
    for method in CLUSTER_METHODS:
        env = {"RADIXSERVE_MODEL": options.model, "RADIXSERVE_SPECULATIVE_METHOD": method}
        progress(f"cluster: starting radixserve up with speculative method {method}")
        with LocalCluster(ClusterConfig(port=0, engine_env=env)) as cluster:
            http = httpx.Client(base_url=cluster.url, timeout=600)
            with http:
                warm = build_workload("open-chat", -1, 1).conversations[0].turns[0]([])
                stream_chat(http, options.model, warm, 16)
                for workload in CLUSTER_WORKLOADS:
                    progress(f"cluster: {workload} B1 {method}")
                    work = build_workload(workload, options.seed * 1000 + 7,
                                          options.batch1_conversations)  # fmt: skip
                    max_tokens = options.max_tokens.get(workload, options.default_max_tokens)
                    before = speculation_counters(http.get("/metrics").text)
                    streams = [stream_chat(http, options.model, c.turns[0]([]), max_tokens)
                               for c in work.conversations]  # fmt: skip
                    after = speculation_counters(http.get("/metrics").text)
                    moved = {k: after[k] - before[k] for k in _WHATS}
                    row = {"workload": workload, "method": method, **_figures(streams, moved)}
                    cells.append(row)
                    texts[(workload, method)] = [s["text"] for s in streams]
    found = []
    for row in cells:
        base = next(r for r in cells if r["workload"] == row["workload"] and r["method"] == "off")
        if base["itl_ms"]["mean"] and row["itl_ms"]["mean"]:
            row["itl_mean_vs_off"] = row["itl_ms"]["mean"] / base["itl_ms"]["mean"]
        ref, got = texts[(row["workload"], "off")], texts[(row["workload"], row["method"])]
        for c, (a, b) in enumerate(zip(ref, got)):
            if a != b:
                found.append({"workload": row["workload"], "batch": 1, "method": row["method"],
                              "through_cluster": True, "conversation": c, "turn": 0,
                              "off_text": a[:300], "text": b[:300]})  # fmt: skip
                progress(f"!!! MISMATCH through the cluster: {row['method']} {row['workload']} "
                         f"conversation {c}: {b[:120]!r} vs {a[:120]!r}")  # fmt: skip
    return {"cells": cells, "mismatches": found}
