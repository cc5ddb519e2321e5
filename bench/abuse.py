"""`radixserve bench --scenario abuse`: one tenant floods the cluster while another chats.

One local cluster (gateway, one prefill and one decode worker, the kvstore; KV over
NIXL), API keys for three tenants: ``chat`` (well-behaved), ``flood`` (with a
``requests_per_minute`` on its key) and ``ops`` (the admin key that reads /debug/cache).
With three tenants each may hold ``tenant_work_share`` (0.5) of the gateway's bounds;
``max_queued_requests`` is set low (`MAX_QUEUED_REQUESTS`) so that share is a dozen
prompts. In one run:

1. **alone**: the chat tenant's multi-turn chat (a long system prompt, then questions,
   each answer appended; streamed, greedy), TTFT and inter-token latency measured by the
   client;
2. **under flood**: the same chat with another opening (nothing of it cached), while the
   flood tenant sends (`abuse_flood`) a 256-prompt completion with ``ignore_eos``,
   streams it never reads (a small SO_RCVBUF), a non-streamed answer it hangs up on, a
   3 MiB JSON schema, a body and a request head a byte at a time, and a loop of short
   completions retried as fast as they are answered;
3. **after**: the load stopped, the cluster is given until a few heartbeats later to
   settle, and /debug/cache must show nothing held: no request in flight at the gateway
   or admitted, no live request, locked page, lease or task on any worker.

The gateway's ``stream_idle_timeout_s``, ``body_read_timeout_s`` and
``header_timeout_s`` are set short (`TIMEOUTS_S`) so that the cuts come within the run;
the report says so. Targets: the chat tenant's requests all succeed, its cached-turn
TTFT p90 under flood within 3x of alone and ITL p50 within 2x; the flood gets 429s that
name its limit; nothing held afterwards. Prints a table; ``--out`` writes JSON.
"""

from __future__ import annotations

import json
import math
import os
import platform
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from radixserve.bench import abuse_flood as flood
from radixserve.bench.chaos_report import HELD_KEYS
from radixserve.bench.gateway_chat import QUESTIONS, system_prompt
from radixserve.bench.local_cluster import LocalCluster
from radixserve.launch.cluster import ClusterConfig

MAX_QUEUED_REQUESTS = 24  # a tenant's share: 12 prompts in flight
MAX_QUEUED_WORK_TOKENS = 65536  # ... and 32768 tokens of work
FLOOD_REQUESTS_PER_MINUTE = 30
TIMEOUTS_S = {"quick": 1.0, "full": 2.0}  # stream idle, body read, request head
#: what must be 0 on every worker that is up once the cluster has settled
HELD = (*HELD_KEYS, "disk_leases", "disk_pages_leased")
TARGETS = {"ttft_p90_ratio": 3.0, "itl_p50_ratio": 2.0}
#: the settings a refusal of the flood must name (its share, or a rate on its key)
LIMIT_NAMES = ("tenant_work_share", "requests_per_minute", "tokens_per_minute")


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"stores": 6, "turns": 3, "max_tokens": 16, "unread": 4, "unread_n": 8,
                "unread_tokens": 256, "loop_workers": 10, "loop_tokens": 24, "min_flood_s": 3}  # fmt: skip
    return {"stores": 28, "turns": 8, "max_tokens": 48, "unread": 8, "unread_n": 8,
            "unread_tokens": 256, "loop_workers": 8, "loop_tokens": 64, "min_flood_s": 0}  # fmt: skip


def _config(model: str, keys: dict[str, str], timeout_s: float) -> ClusterConfig:
    # the engine's defaults (bfloat16 where the CPU has it, the native decode step), as
    # `make serve` runs them: what a user's chat would see
    engine_env = {"RADIXSERVE_KV_CACHE_MEMORY_GIB": "1.0", "RADIXSERVE_DEVICE": "cpu"}
    if model != "default":
        engine_env["RADIXSERVE_MODEL"] = model
    entries = [{"key": keys["chat"], "tenant": "chat"},
               {"key": keys["flood"], "tenant": "flood",
                "requests_per_minute": FLOOD_REQUESTS_PER_MINUTE},
               {"key": keys["ops"], "tenant": "ops", "role": "admin"}]  # fmt: skip
    gateway_env = {
        "RADIXSERVE_GATEWAY_API_KEYS": json.dumps(entries),
        "RADIXSERVE_GATEWAY_MAX_QUEUED_REQUESTS": str(MAX_QUEUED_REQUESTS),
        "RADIXSERVE_GATEWAY_MAX_QUEUED_WORK_TOKENS": str(MAX_QUEUED_WORK_TOKENS),
        "RADIXSERVE_GATEWAY_STREAM_IDLE_TIMEOUT_S": str(timeout_s),
        "RADIXSERVE_GATEWAY_BODY_READ_TIMEOUT_S": str(timeout_s),
        "RADIXSERVE_GATEWAY_HEADER_TIMEOUT_S": str(timeout_s),
    }
    threads = max(1, (os.cpu_count() or 1) // 2)
    return ClusterConfig(port=0, engine_env=engine_env, gateway_env=gateway_env,
                         num_threads=threads)  # fmt: skip


def stream_turn(
    client: httpx.Client, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, Any]:
    """One streamed greedy chat turn: status, TTFT, the gaps between content events, text."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    stamps: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            return {"status": resp.status_code, "error": resp.text[:300]}
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"status": 200, "error": str(event["error"])[:300]}
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                if content := choice["delta"].get("content"):
                    stamps.append(time.perf_counter())
                    text.append(content)
    if not stamps:
        return {"status": 200, "error": "no content in the stream"}
    return {
        "status": 200,
        "ttft_ms": (stamps[0] - start) * 1000,
        "itl_ms": [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])],
        "text": "".join(text),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


def run_chat(
    url: str, key: str, opening: str, system: str, turns: int, max_tokens: int
) -> list[dict[str, Any]]:
    """The chat tenant's conversation; ``opening`` makes its prompts its own (uncached)."""
    rows = []
    messages = [{"role": "system", "content": f"{opening} {system}"}]
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
        for i in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
            row = stream_turn(client, messages, max_tokens)
            rows.append({k: v for k, v in row.items() if k != "text"})
            messages.append({"role": "assistant", "content": row.get("text", "")})
            print(f"    {opening} turn {i + 1}: {row.get('ttft_ms', float('nan')):.1f} ms TTFT, "
                  f"status {row['status']}", file=sys.stderr)  # fmt: skip
    return rows


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)  # nearest rank: p90 of 7 turns is the slowest
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def chat_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT p50/p90 of the cached turns (2..N) and ITL p50 over every turn."""
    cached = [r["ttft_ms"] for r in rows[1:] if "ttft_ms" in r]
    gaps = [g for r in rows for g in r.get("itl_ms", [])]
    return {"turns": len(rows), "succeeded": sum(1 for r in rows if "error" not in r),
            "cached_ttft_p50_ms": _percentile(cached, 0.5),
            "cached_ttft_p90_ms": _percentile(cached, 0.9),
            "itl_p50_ms": _percentile(gaps, 0.5),
            "cached_tokens": [r.get("cached_tokens", 0) for r in rows]}  # fmt: skip


class Flood:
    """The flood tenant's abuses (`abuse_flood`), started together, ended by `stop`."""

    def __init__(self, url: str, key: str, sizes: dict[str, int], timeout_s: float) -> None:
        self.url, self.key, self.timeout_s = url, key, timeout_s
        self.result: dict[str, Any] = {}
        self.client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"},
                                   timeout=120)  # fmt: skip
        self.loop = flood.RetryLoop(url, key, sizes["loop_workers"], sizes["loop_tokens"])
        self.unread = [flood.UnreadStream(url, key, sizes["unread_n"], sizes["unread_tokens"])
                       for _ in range(sizes["unread"])]  # fmt: skip
        self._threads: list[threading.Thread] = []

    def _background(self, name: str, fn: Any, *args: Any) -> None:
        def run() -> None:
            self.result[name] = fn(*args)

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def start(self) -> None:
        self.result["big_batch"] = flood.big_batch(self.client, 256, 256)
        for stream in self.unread:
            stream.open()
        self._background("disconnect", flood.disconnect_mid_answer, self.url, self.key, 1.0)
        limit = 6 * self.timeout_s + 5
        self._background("slow_body", flood.slow_body, self.url, self.key, 0.25, limit)
        self._background("slow_head", flood.slow_head, self.url, 0.25, limit)
        self.result["big_schema"] = flood.big_schema(self.client, 3 << 20)
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        for thread in self._threads:
            thread.join()
        # a stream the gateway cut is reset by now; one still open is read for a while
        ends = [s.end(timeout_s=self.timeout_s + 1) for s in self.unread]
        self.result["unread_streams"] = {
            "opened": len(self.unread),
            "statuses": [s.status for s in self.unread],
            "ends": {e: ends.count(e) for e in sorted(set(ends))},
        }
        self.result["retry_loop"] = {"statuses": {str(k): v for k, v in sorted(self.loop.statuses.items())},
                                     "refusal_messages": list(self.loop.messages.values())}  # fmt: skip
        self.client.close()


def settle(cluster: LocalCluster, timeout_s: float) -> tuple[dict[str, Any], float]:
    """Wait until /debug/cache, on heartbeats sent after now, shows nothing held (or
    ``timeout_s`` passes); the last /debug/cache and the seconds it took."""
    start = time.monotonic()
    beats = {n: w.get("heartbeats_total", 0) for n, w in cluster.workers().items()}
    last: dict[str, Any] = {}
    while time.monotonic() - start < timeout_s:
        last = cluster.debug_cache()
        workers = last["workers"]
        fresh = all(not w["up"] or w.get("heartbeats_total", 0) > beats.get(n, 0) + 1
                    for n, w in workers.items())  # fmt: skip
        if fresh and not held_report(last):
            break
        time.sleep(0.2)
    return last, time.monotonic() - start


def held_report(debug: dict[str, Any]) -> dict[str, Any]:
    """What /debug/cache shows held: gateway counts and per-worker `HELD` keys (non-zero)."""
    held: dict[str, Any] = {}
    admitted = debug.get("gateway_admission", {})
    for key, value in (("gateway_in_flight", debug.get("gateway_in_flight", 0)),
                       ("admitted_requests", admitted.get("requests", 0)),
                       ("admitted_work_tokens", admitted.get("work_tokens", 0))):  # fmt: skip
        if value:
            held[key] = value
    for name, w in sorted(debug["workers"].items()):
        nonzero = {k: w[k] for k in HELD if w.get("up") and w.get(k)}
        if nonzero:
            held[name] = nonzero
    return held


def _gateway_counters(url: str) -> dict[str, dict[str, float]]:
    """The refusal and cut-connection counters of the gateway's /metrics, by label."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found: dict[str, dict[str, float]] = {"refused": {}, "cut": {}}
    for line in text.splitlines():
        for prefix, kind in (("radixserve_refused_requests_total{", "refused"),
                             ("radixserve_gateway_cut_connections_total{", "cut")):  # fmt: skip
            if line.startswith(prefix):
                labels, value = line[len(prefix) :].rsplit("} ", 1)
                reason = labels.split('reason="', 1)[-1].split('"', 1)[0]
                found[kind][reason] = float(value)
    return found


def run_abuse_bench(
    quick: bool = False, out_path: str | None = None, model: str = "default"
) -> int:
    preset = "quick" if quick else "full"
    sizes, timeout_s = _sizes(quick), TIMEOUTS_S[preset]
    keys = {t: f"{t}-{secrets.token_hex(16)}" for t in ("chat", "flood", "ops")}
    system = system_prompt(sizes["stores"])
    started = time.monotonic()
    load = os.getloadavg()[0]
    with LocalCluster(_config(model, keys, timeout_s)) as cluster:
        url = cluster.url
        run_chat(url, keys["chat"], "Warm-up.", "Say hi.", 1, 2)
        print("abuse bench: the chat alone ...", file=sys.stderr)
        alone = run_chat(
            url, keys["chat"], "Conversation A.", system, sizes["turns"], sizes["max_tokens"]
        )
        print("abuse bench: the same chat under the flood ...", file=sys.stderr)
        attack = Flood(url, keys["flood"], sizes, timeout_s)
        attack.start()
        try:
            flood_end = time.monotonic() + sizes["min_flood_s"]
            flooded = run_chat(url, keys["chat"], "Conversation B.", system, sizes["turns"],
                               sizes["max_tokens"])  # fmt: skip
            time.sleep(max(0.0, flood_end - time.monotonic()))  # a floor, for tiny models
        finally:
            attack.stop()
        print("abuse bench: waiting for the cluster to settle ...", file=sys.stderr)
        final, settle_s = settle(cluster, 60.0)
        counters = _gateway_counters(url)
    result = report(preset, sizes, timeout_s, alone, flooded, attack.result, final, settle_s,
                    counters, {"load_average_at_start": load,
                               "seconds": time.monotonic() - started, "model": model})  # fmt: skip
    print(format_table(result))
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {out_path}", file=sys.stderr)
    return 0 if all(result["targets"].values()) else 1


def report(preset: str, sizes: dict[str, int], timeout_s: float, alone: list[dict[str, Any]],
           flooded: list[dict[str, Any]], attack: dict[str, Any], final: dict[str, Any],
           settle_s: float, counters: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    a, f = chat_summary(alone), chat_summary(flooded)

    def ratio(key: str) -> float | None:
        return f[key] / a[key] if a[key] and f[key] is not None else None

    held = held_report(final)
    loop = attack["retry_loop"]
    refusals = loop["refusal_messages"]
    ratios = {"cached_ttft_p90": ratio("cached_ttft_p90_ms"), "itl_p50": ratio("itl_p50_ms")}
    targets = {
        "chat_all_succeeded": a["succeeded"] == a["turns"] and f["succeeded"] == f["turns"],
        "ttft_p90_within_3x": ratios["cached_ttft_p90"] is not None
        and ratios["cached_ttft_p90"] <= TARGETS["ttft_p90_ratio"],
        "itl_p50_within_2x": ratios["itl_p50"] is not None
        and ratios["itl_p50"] <= TARGETS["itl_p50_ratio"],
        "flood_429s_name_its_limit": int(loop["statuses"].get("429", 0)) > 0
        and all("tenant flood" in m and any(limit in m for limit in LIMIT_NAMES) for m in refusals),
        "nothing_held_after": not held,
    }
    return {
        "scenario": "abuse",
        "preset": preset,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), **run},
        "settings": {
            "max_queued_requests": MAX_QUEUED_REQUESTS,
            "max_queued_work_tokens": MAX_QUEUED_WORK_TOKENS,
            "tenant_work_share": 0.5,
            "flood_requests_per_minute": FLOOD_REQUESTS_PER_MINUTE,
            "stream_idle_timeout_s": timeout_s,
            "body_read_timeout_s": timeout_s,
            "header_timeout_s": timeout_s,
            "note": "timeouts shortened for the benchmark (defaults 30, 30 and 15 s) so the "
            "cuts come within the run",
        },
        "sizes": sizes,
        "chat": {
            "alone": a,
            "under_flood": f,
            "ratios": ratios,
            "turns_alone": alone,
            "turns_under_flood": flooded,
        },
        "flood": attack,
        "gateway_counters": counters,
        "after": {
            "held": held,
            "settle_s": settle_s,
            "admission": final.get("gateway_admission", {}),
        },
        "targets": targets,
    }


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def format_table(r: dict[str, Any]) -> str:
    a, f, ratios = r["chat"]["alone"], r["chat"]["under_flood"], r["chat"]["ratios"]
    s, fl = r["settings"], r["flood"]
    lines = [
        f"abuse benchmark ({r['preset']}): tenant chat's {a['turns']}-turn chat alone, then "
        "under tenant flood's abuse (1 prefill + 1 decode, NIXL)",
        f"(stream_idle_timeout_s, body_read_timeout_s, header_timeout_s = {s['stream_idle_timeout_s']:g} s, "
        "shortened for the run; max_queued_requests "
        f"{s['max_queued_requests']}, max_queued_work_tokens {s['max_queued_work_tokens']}, share {s['tenant_work_share']:g}, flood rpm "
        f"{s['flood_requests_per_minute']})",
        "",
        "| chat tenant | succeeded | cached TTFT p50 (ms) | cached TTFT p90 (ms) | ITL p50 (ms) |",
        "|---|---|---|---|---|",
    ]
    for name, c in (("alone", a), ("under flood", f)):
        lines.append(f"| {name} | {c['succeeded']}/{c['turns']} | {_ms(c['cached_ttft_p50_ms'])} "
                     f"| {_ms(c['cached_ttft_p90_ms'])} | {_ms(c['itl_p50_ms'])} |")  # fmt: skip
    ttft, itl = ratios["cached_ttft_p90"], ratios["itl_p50"]
    lines += [
        f"| ratio | | | {'n/a' if ttft is None else f'{ttft:.2f}x'} (≤ 3x) "
        f"| {'n/a' if itl is None else f'{itl:.2f}x'} (≤ 2x) |",
        "",
        f"flood: 256-prompt completion → {fl['big_batch']['status']}: {fl['big_batch']['message']}",
        f"flood: 3 MiB JSON schema → {fl['big_schema']['status']}: {fl['big_schema']['message']}",
        f"flood: {fl['unread_streams']['opened']} unread streams (n={r['sizes']['unread_n']}, "
        f"{r['sizes']['unread_tokens']} tokens, top-20 logprobs), heads "
        f"{fl['unread_streams']['statuses']}, ended {fl['unread_streams']['ends']}",
        f"flood: hung up mid answer after {fl['disconnect']['hung_up_after_s']:g} s; slow body → "
        f"{fl['slow_body']['status']} after {fl['slow_body']['after_s']:.1f} s; slow head closed: "
        f"{fl['slow_head']['closed']} after {fl['slow_head']['after_s']:.1f} s",
        f"flood: retry loop statuses {fl['retry_loop']['statuses']}",
    ]
    lines += [f"  429/400: {m}" for m in fl["retry_loop"]["refusal_messages"]]
    lines += [
        f"gateway counters: refused {r['gateway_counters']['refused']}, cut "
        f"{r['gateway_counters']['cut']}",
        f"after ({r['after']['settle_s']:.1f} s to settle): held {r['after']['held'] or 'nothing'}",
        "targets: " + ", ".join(f"{k} {'✓' if v else '✗'}" for k, v in r["targets"].items()),
    ]
    return "\n".join(lines)
