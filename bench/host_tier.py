"""`radixserve bench --scenario host-tier`: a long prefix from the host tier, next to
recomputing it and next to a device hit.

One cluster (the kvstore with a 1 GiB host tier, one decode worker that prefills
locally, the gateway); its KV pool holds one ``prefix``-token document but not three.
Each round:

1. **recompute**: a new document and a question; nothing is cached, the whole prompt is
   computed;
2. **device**: the same document, another question: the prefix is on the device;
3. two other new documents push the first out of the device pool; the worker spills
   its pages into the host tier;
4. **host**: the first document, a third question: the worker finds nothing on device,
   loads the prefix from the host tier and computes only the question.

TTFT is measured by the client (request sent to the first streamed token). The table
gives each path per round, the medians and the ratios host/recompute (the target: at
most 0.30 for a 4k-token prefix) and device/recompute, with the pages and bytes the
worker loaded from the host tier. ``--out`` writes JSON.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx
import torch

from radixserve.bench.gateway_chat import stream_turn, system_prompt
from radixserve.bench.local_cluster import LocalCluster, metric_value
from radixserve.cache.kv_pool import KVPool
from radixserve.launch.cluster import ClusterConfig
from radixserve.model.model_files import open_model

QUESTIONS = ("Which store is open the longest?", "Can I pay by direct debit?",
             "What does a replacement SIM cost?")  # fmt: skip
_BASE_TOKENS, _TOKENS_PER_STORE = 221, 45.1  # measured with SmolLM2's tokenizer


def document(i: int, prefix_tokens: int) -> str:
    """A document of about ``prefix_tokens`` tokens whose first page differs per ``i``."""
    stores = max(1, round((prefix_tokens - _BASE_TOKENS) / _TOKENS_PER_STORE))
    return f"Reference document {i}. " + system_prompt(stores)


def _delta(before: str, after: str, name: str, **labels: str) -> float:
    """How much metric ``name`` grew between two /metrics texts."""
    return metric_value(after, name, **labels) - metric_value(before, name, **labels)


def _metrics_after_load(cluster: LocalCluster, client: httpx.Client, before: str) -> str:
    """/metrics once the worker's heartbeat has reported the host-tier load that just
    happened (worker counters reach the gateway with heartbeats, not with the answer)."""
    name = "radixserve_worker_host_loads_total"
    text = before

    def reported() -> bool:
        nonlocal text
        text = client.get("/metrics").text
        return metric_value(text, name) > metric_value(before, name)

    cluster.wait(reported, 10, "the worker to report its host-tier load")
    return text


def _turn(client: httpx.Client, doc: str, question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": doc}, {"role": "user", "content": question}]
    return stream_turn(client, messages, 4)


def run_host_tier_bench(
    quick: bool = False, out_path: str | None = None, model: str = "default"
) -> int:
    """``model``: the checkpoint the worker serves (``--model``; the pool is sized by its
    pages). The documents are sized with SmolLM2's tokenizer, so a model of another
    tokenizer gets prefixes of other lengths."""
    prefix, rounds = (1024, 1) if quick else (4096, 3)
    shape = open_model(model).config
    page_bytes = KVPool.page_bytes_all_layers(shape, 16, torch.float32)  # fp32, 16-token pages
    pool_gib = (prefix * 1.7 / 16) * page_bytes / (1 << 30)  # one document, not three
    env = {
        "RADIXSERVE_MODEL": model,
        "RADIXSERVE_DEVICE": "cpu",
        "RADIXSERVE_DTYPE": "float32",
        "RADIXSERVE_KV_CACHE_MEMORY_GIB": f"{pool_gib:.4f}",
        "RADIXSERVE_MAX_MODEL_LEN": str(prefix + 512),
    }
    threads = os.cpu_count() or 1
    config = ClusterConfig(num_prefill=0, num_decode=1, port=0, engine_env=env,
                           num_threads=threads, host_tier_gib=1.0)  # fmt: skip
    rows: list[dict[str, Any]] = []
    print(f"host-tier bench: {rounds} round(s), {prefix}-token prefix, KV pool "
          f"{pool_gib:.2f} GiB, host tier 1 GiB ...", file=sys.stderr)  # fmt: skip
    with LocalCluster(config) as cluster, httpx.Client(base_url=cluster.url, timeout=900) as c:
        cluster.wait_host_tier()
        stream_turn(c, [{"role": "user", "content": "Warm-up: say hi."}], 2)
        for r in range(rounds):
            doc = document(4 * r, prefix)
            recompute = _turn(c, doc, QUESTIONS[0])
            device = _turn(c, doc, QUESTIONS[1])
            for k in (1, 2):
                _turn(c, document(4 * r + k, prefix), QUESTIONS[0])
            before = c.get("/metrics").text
            host = _turn(c, doc, QUESTIONS[2])
            after = _metrics_after_load(cluster, c, before)
            row = {
                "round": r + 1,
                "prompt_tokens": host["prompt_tokens"],
                "recompute_ttft_ms": recompute["ttft_ms"],
                "device_ttft_ms": device["ttft_ms"],
                "host_ttft_ms": host["ttft_ms"],
                "device_cached_tokens": device["cached_tokens"],
                "host_cached_tokens": int(
                    _delta(before, after, "radixserve_cached_tokens_total", tier="host")
                ),
                "host_path_device_cached_tokens": int(
                    _delta(before, after, "radixserve_cached_tokens_total", tier="device")
                ),
                "host_load_pages": int(
                    _delta(before, after, "radixserve_worker_host_load_pages_total")
                ),
                "host_load_bytes": int(
                    _delta(before, after, "radixserve_worker_host_load_bytes_total")
                ),
                # the decode worker's page, as its engine states it (`EngineInfo.geometry`)
                "page_bytes": int(
                    metric_value(after, "radixserve_worker_page_bytes", worker="decode-0")
                ),  # fmt: skip
                "host_load_ms": 1000.0
                * _delta(before, after, "radixserve_worker_host_load_seconds_total"),
            }
            rows.append(row)
            print(f"  round {r + 1}: recompute {row['recompute_ttft_ms']:.0f} ms, device "
                  f"{row['device_ttft_ms']:.0f} ms, host {row['host_ttft_ms']:.0f} ms "
                  f"({row['host_cached_tokens']} tokens from the host tier)",
                  file=sys.stderr)  # fmt: skip

    def median(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    result = {
        "scenario": "host-tier",
        "preset": "quick" if quick else "full",
        "prefix_tokens": prefix,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
        "rows": rows,
        "median_ms": {k: median(f"{k}_ttft_ms") for k in ("recompute", "device", "host")},
    }
    med = result["median_ms"]
    result["host_over_recompute"] = med["host"] / med["recompute"]
    result["device_over_recompute"] = med["device"] / med["recompute"]
    print(format_table(result))
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {out_path}", file=sys.stderr)
    return 0


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"### Host tier: TTFT of a {r['prefix_tokens']}-token prefix by where it comes from",
        "",
        "| round | prompt | recompute ms | device hit ms | host tier ms | from host | "
        "pages loaded | load ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['round']} | {row['prompt_tokens']} | {row['recompute_ttft_ms']:.0f} | "
            f"{row['device_ttft_ms']:.0f} | {row['host_ttft_ms']:.0f} | "
            f"{row['host_cached_tokens']} | {row['host_load_pages']} | "
            f"{row['host_load_ms']:.1f} |"
        )
    med = r["median_ms"]
    lines += [
        "",
        f"median: recompute {med['recompute']:.0f} ms, device hit {med['device']:.0f} ms, "
        f"host tier {med['host']:.0f} ms",
        f"host / recompute = {r['host_over_recompute']:.3f} (target <= 0.30); "
        f"device / recompute = {r['device_over_recompute']:.3f}",
    ]
    return "\n".join(lines)
