"""`radixserve bench --scenario tiers`: a prefix pool larger than host memory, each
prefix served from where it lies (device, host tier, disk tier) or recomputed.

One cluster: the kvstore with a host tier holding a quarter of the pool's KV over a
disk tier (files in a temporary directory on this machine's disk, removed afterwards),
one decode worker that prefills locally, whose KV pool holds about one of the longest
prefixes, with ``host_load_min_tokens`` 0 so that every prefix length asks the tiers.
The pool is ``rounds`` times each prefix length (`PRESETS`: seed, 3 rounds of 32 to
4096 tokens, doubling; pool, 64 prefixes of 4096 tokens; quick, a smoke run), each a
document of its own, as an aiperf-like synthetic workload draws prefixes:

1. **fill**: each document once, with a first question: nothing is cached, so its TTFT
   is the prompt recomputed;
2. **revisit**: each document again, oldest first (each prefix then lies deepest: on
   disk), with a second question, then in a seeded random order (an aiperf-like draw:
   hits from every tier) with a third; the gateway's
   ``radixserve_cached_tokens_total{tier}`` before and after says where each prefix came
   from (the deepest tier that served any of it; none: recomputed). A warm-up document
   goes first and is not counted (the first read through the tiers also connects the
   transfer agents);
3. **overlap A/B**: the kvstore is restarted on its directory (its host memory empty,
   everything not on the device on disk) with ``disk_read_overlap`` off, then on
   (alternating, `OVERLAP_PASSES`), and each document (quick: of the longest length)
   is revisited oldest first: the disk hits' TTFT with the disk read and the worker's
   read one after the other, and overlapped chunk by chunk.

Reported, from one run: per tier the share of revisits it served and the TTFT p50/p90
of those hits beside the same prompts' recompute TTFT; per prefix length the disk hit's
TTFT over the recompute's (the median of the pairs, and each side's quickest run over
the other's: load on a shared machine slows the compute-bound recompute far more than
a read), the crossover (the shortest length from which a disk hit is quicker, by the
quickest runs); and the two rates the admission compares (the kvstore's measured disk
read rate, the worker's prefill rate), as seconds per page; per prefix length the disk
hits' TTFT p50 sequential and overlapped. ``--out`` writes JSON.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch

from radixserve.bench.gateway_chat import stream_turn, system_prompt
from radixserve.bench.local_cluster import LocalCluster, metric_value
from radixserve.bench.peer_report import write_json
from radixserve.bench.report import percentile
from radixserve.cache.kv_pool import KVPool
from radixserve.launch.cluster import ClusterConfig, kvstore_spec
from radixserve.model.model_files import open_model

TIERS = ("disk", "host", "device")
QUESTIONS = ("Which store opens first?", "Which stores repair phones?",
             "Which store closes last?", "Which store sells maps?")  # fmt: skip
PAGE = 16
#: (prefix lengths, rounds of them) per preset; "pool": the aiperf-like pool of 64
#: prefixes of 4k tokens, host memory holding a quarter of it
PRESETS = {
    "quick": ([128, 256, 512], 4),
    "seed": ([32, 64, 128, 256, 512, 1024, 2048, 4096], 3),
    "pool": ([4096], 64),
}
#: the kvstore's disk_read_overlap in the A/B passes (ABBA: a drift over the passes
#: weighs on both modes alike)
OVERLAP_PASSES = {"quick": (False, True), "seed": (False, True, True, False),
                  "pool": (False, True, True, False)}  # fmt: skip


def documents(model: str, lengths: list[int], rounds: int) -> list[tuple[int, str]]:
    """(length, text) of ``rounds`` x ``lengths`` documents of about that many tokens,
    each different from its first page on."""
    tokenizer = open_model(model).tokenizer
    body = system_prompt(120)
    out = []
    for r in range(rounds):
        for length in lengths:
            ids = tokenizer.encode(f"Reference document {len(out)} of round {r}. {body}")
            out.append((length, tokenizer.decode(ids[:length])))
    return out


def _ask(client: httpx.Client, doc: str, question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": doc}, {"role": "user", "content": question}]
    return stream_turn(client, messages, 2)


def _tier_tokens(text: str) -> dict[str, float]:
    return {t: metric_value(text, "radixserve_cached_tokens_total", tier=t) for t in TIERS}


def _served_by(before: dict[str, float], after: dict[str, float]) -> str:
    """The deepest tier that served some of a prompt's prefix ("recompute": none)."""
    return next((t for t in TIERS if after[t] > before[t]), "recompute")


def run_tiers_bench(
    preset: str = "seed", out_path: str | None = None, model: str = "default"
) -> int:
    """``preset``: a key of `PRESETS`; ``model``: the checkpoint served (``--model``);
    the pool is sized by its pages."""
    lengths, rounds = PRESETS[preset]
    docs = documents(model, lengths, rounds)
    docs.insert(0, (lengths[0], "Warm-up. " + docs[0][1]))  # its own from the first token
    page_bytes = KVPool.page_bytes_all_layers(open_model(model).config, PAGE, torch.float32)
    pool_pages = sum(-(-n // PAGE) + 2 for n, _ in docs)
    gib = page_bytes / (1 << 30)
    env = {"RADIXSERVE_MODEL": model, "RADIXSERVE_DEVICE": "cpu", "RADIXSERVE_DTYPE": "float32",
           "RADIXSERVE_KV_CACHE_MEMORY_GIB": f"{1.5 * max(lengths) / PAGE * gib:.6f}",
           "RADIXSERVE_MAX_MODEL_LEN": str(max(lengths) + 512)}  # fmt: skip
    disk_dir = tempfile.mkdtemp(prefix="radixserve-tiers-")
    config = ClusterConfig(
        num_prefill=0, num_decode=1, port=0, engine_env=env,
        num_threads=os.cpu_count() or 1, host_tier_gib=round(pool_pages / 4 * gib, 6),
        disk_tier_dir=disk_dir, disk_tier_gib=round(2 * pool_pages * gib + 0.01, 6),
        decode_env={"RADIXSERVE_DECODE_HOST_LOAD_MIN_TOKENS": "0"},
    )  # fmt: skip
    print(f"tiers bench: {len(docs)} prefixes of {lengths} tokens ({pool_pages} pages, "
          f"{pool_pages * gib:.2f} GiB), host tier a quarter of it, disk tier in "
          f"{disk_dir} ...", file=sys.stderr)  # fmt: skip
    rows: list[dict[str, Any]] = []
    overlap: list[dict[str, Any]] = []
    try:
        with LocalCluster(config) as cluster, httpx.Client(base_url=cluster.url, timeout=900) as c:
            cluster.wait_host_tier()
            _ask(c, "Warm-up.", "Say hi.")
            fills = [_ask(c, doc, QUESTIONS[0]) for _, doc in docs]
            _ask(c, docs[0][1], QUESTIONS[1])  # the first read through the tiers connects them
            oldest_first = list(range(1, len(docs)))
            drawn = random.Random(0).sample(oldest_first, len(oldest_first))
            for order, question in ((oldest_first, QUESTIONS[1]), (drawn, QUESTIONS[2])):
                rows += [_revisit(c, docs[i], fills[i], question) for i in order]
            rates = _rates(c.get("/metrics").text, page_bytes)
            for on in OVERLAP_PASSES[preset]:
                _restart_kvstore(cluster, on)
                _ask(c, docs[0][1], QUESTIONS[0])  # connects the agents again (not counted)
                again = [i for i in oldest_first if preset != "quick" or docs[i][0] == lengths[-1]]
                passed = [_revisit(c, docs[i], fills[i], QUESTIONS[3]) for i in again]
                overlap += [{**r, "overlap": on} for r in passed if r["tier"] == "disk"]
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    result = summarise(rows, rates, preset, lengths)
    result["overlap"] = summarise_overlap(overlap, lengths)
    print(format_table(result))
    if out_path:
        write_json(result, Path(out_path))
        print(f"wrote {out_path}", file=sys.stderr)
    return 0


def _restart_kvstore(cluster: LocalCluster, overlap: bool) -> None:
    """Stop the kvstore (SIGTERM: it writes its host tier's pages to disk) and start it
    again on its port and directory with ``disk_read_overlap`` = ``overlap``: its host
    memory starts empty, so every prefix not on the device comes back from disk."""
    old = cluster.workers()["kvstore"]
    [listener] = cluster.supervisor.spec("kvstore").sockets.values()
    env = {**cluster.config.engine_env, "RADIXSERVE_KVSTORE_DISK_READ_OVERLAP": str(overlap)}
    config = dataclasses.replace(cluster.config, engine_env=env)
    spec = kvstore_spec(config, listener.dup())  # its socket, kept: the same port
    cluster.supervisor.retire("kvstore", 60)
    cluster.wait(lambda: "kvstore" not in cluster.supervisor.names(), 90, "the kvstore to stop")
    cluster.supervisor.add(spec)
    cluster.wait_restarted("kvstore", old["generation"])
    cluster.wait_host_tier()
    cluster.wait(lambda: cluster.worker("kvstore").get("disk_restored_pages", 0) > 0, 120,
                 "the kvstore's disk index rebuilt")  # fmt: skip
    print(f"  kvstore restarted, disk_read_overlap={overlap}", file=sys.stderr)


def _revisit(
    c: httpx.Client, doc: tuple[int, str], fill: dict[str, Any], question: str
) -> dict[str, Any]:
    """Ask ``doc`` again; where its prefix came from, its TTFT and its fill's."""
    length, text = doc
    before = _tier_tokens(c.get("/metrics").text)
    hit = _ask(c, text, question)
    tier = _served_by(before, _tier_tokens(c.get("/metrics").text))
    print(f"  {length:5d} tokens: {tier:9s} {hit['ttft_ms']:8.1f} ms "
          f"(recomputed: {fill['ttft_ms']:.1f} ms)", file=sys.stderr)  # fmt: skip
    return {"prefix_tokens": length, "prompt_tokens": hit["prompt_tokens"], "tier": tier,
            "cached_tokens": hit["cached_tokens"], "ttft_ms": hit["ttft_ms"],
            "recompute_ttft_ms": fill["ttft_ms"]}  # fmt: skip


def _rates(metrics: str, page_bytes: int) -> dict[str, float]:
    """The two rates the admission compares, per page: the kvstore's disk read (a
    record is the page and a 4 KiB header, aligned) and the worker's prefill."""
    read = metric_value(metrics, "radixserve_worker_disk_read_bytes_per_s", worker="kvstore")
    tokens = metric_value(metrics, "radixserve_worker_engine_prefill_tokens_total", role="decode")
    seconds = metric_value(metrics, "radixserve_worker_engine_prefill_seconds_total", role="decode")
    record = 4096 + -(-page_bytes // 4096) * 4096
    return {
        "disk_read_bytes_per_s": read,
        "prefill_tokens_per_s": tokens / seconds if seconds else 0.0,
        "disk_read_ms_per_page": 1000 * record / read if read else 0.0,
        "prefill_ms_per_page": 1000 * seconds / tokens * PAGE if tokens else 0.0,
    }


def summarise(rows: list[dict[str, Any]], rates: dict[str, float], preset: str,
              lengths: list[int]) -> dict[str, Any]:  # fmt: skip
    tiers: dict[str, dict[str, float]] = {}
    for tier in (*TIERS, "recompute"):
        hits = [r for r in rows if r["tier"] == tier]
        if hits:
            ttft = [r["ttft_ms"] for r in hits]
            tiers[tier] = {
                "hit_rate": len(hits) / len(rows),
                "ttft_p50_ms": statistics.median(ttft),
                "ttft_p90_ms": percentile(ttft, 90) or 0.0,
                "recompute_p50_ms": statistics.median(r["recompute_ttft_ms"] for r in hits),
            }
    by_length = {}
    for length in lengths:
        disk = [r for r in rows if r["prefix_tokens"] == length and r["tier"] == "disk"]
        if disk:
            hit, again = [r["ttft_ms"] for r in disk], [r["recompute_ttft_ms"] for r in disk]
            by_length[str(length)] = {
                "disk_hits": len(disk),
                "disk_over_recompute": statistics.median(h / a for h, a in zip(hit, again)),
                # each side's least disturbed run (on a shared machine, load slows the
                # compute-bound recompute far more than a read)
                "best_disk_over_best_recompute": min(hit) / min(again),
            }
    measured = sorted(int(n) for n in by_length)
    best = "best_disk_over_best_recompute"
    slower = [n for n in measured if by_length[str(n)][best] >= 1]
    # the shortest length from which every longer one measured was quicker from disk
    crossover = next((n for n in measured if n > max(slower, default=0)), None)
    return {
        "scenario": "tiers",
        "preset": preset,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
        "rows": rows,
        "tiers": tiers,
        "by_length": by_length,
        "crossover_tokens": crossover,
        "rates": rates,
    }


def summarise_overlap(rows: list[dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    """Per prefix length, the disk hits' TTFT p50 with the disk read and the device
    read one after the other (``sequential``) and overlapped, and their ratio."""
    out = {}
    for length in lengths:
        ttft = {
            mode: [r["ttft_ms"] for r in rows
                   if r["prefix_tokens"] == length and r["overlap"] is (mode == "overlapped")]
            for mode in ("sequential", "overlapped")
        }  # fmt: skip
        if all(ttft.values()):
            p50 = {mode: statistics.median(v) for mode, v in ttft.items()}
            out[str(length)] = {
                "disk_hits": {mode: len(v) for mode, v in ttft.items()},
                "sequential_p50_ms": p50["sequential"],
                "overlapped_p50_ms": p50["overlapped"],
                "overlapped_over_sequential": p50["overlapped"] / p50["sequential"],
            }
    return out


def format_table(r: dict[str, Any]) -> str:
    lines = [
        "### Tiers: a prefix pool larger than host memory",
        "",
        "| served from | share of revisits | TTFT p50 ms | TTFT p90 ms | same prompts recomputed, p50 ms |",
        "|---|---|---|---|---|",
    ]
    for tier, v in r["tiers"].items():
        lines.append(f"| {tier} | {100 * v['hit_rate']:.0f} % | {v['ttft_p50_ms']:.0f} | "
                     f"{v['ttft_p90_ms']:.0f} | {v['recompute_p50_ms']:.0f} |")  # fmt: skip
    lines += [
        "",
        "| prefix tokens | disk hits | disk hit / recompute TTFT, median | best / best |",
        "|---|---|---|---|",
    ]
    for length, v in r["by_length"].items():
        lines.append(f"| {length} | {v['disk_hits']} | {v['disk_over_recompute']:.3f} | "
                     f"{v['best_disk_over_best_recompute']:.3f} |")  # fmt: skip
    rates = r["rates"]
    lines += [
        "",
        f"crossover (best / best): a disk hit beats recomputing from {r['crossover_tokens']} "
        f"tokens on (shortest measured: {min(map(int, r['by_length']), default=None)})",
        f"admission inputs: disk read {rates['disk_read_bytes_per_s'] / 1e6:.0f} MB/s = "
        f"{rates['disk_read_ms_per_page']:.2f} ms a page; prefill "
        f"{rates['prefill_tokens_per_s']:.0f} tokens/s = {rates['prefill_ms_per_page']:.1f} ms "
        "a page",
        "",
        "| prefix tokens | disk hits (sequential / overlapped) | disk hit TTFT p50 ms, "
        "disk then device | overlapped | overlapped / sequential |",
        "|---|---|---|---|---|",
    ]
    for length, v in r["overlap"].items():
        hits = v["disk_hits"]
        lines.append(f"| {length} | {hits['sequential']} / {hits['overlapped']} | "
                     f"{v['sequential_p50_ms']:.0f} | {v['overlapped_p50_ms']:.0f} | "
                     f"{v['overlapped_over_sequential']:.3f} |")  # fmt: skip
    return "\n".join(lines)
