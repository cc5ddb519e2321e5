"""`radixserve bench --scenario gateway`: a multi-turn chat through the real cluster.

One conversation (a shared system prompt, then ``turns`` user questions, each answer
appended to the history) is sent through the gateway of a local cluster (one prefill
and one decode worker, KV over NIXL) twice in one run: prefix cache on, then off.
TTFT is measured by the client (request sent → first content event of the SSE
stream). Then, on the quiet machine:

- the same prompts on an in-process engine with the cache on (same CPU threads as a
  worker): the gateway's cached TTFT is compared with the engine's own, turn by turn
  (target: within 15 ms — the price of HTTP, tokenisation and two ZMQ hops);
- NIXL page reads between two processes vs memcpy of the same bytes (target: at least
  half of memcpy), plus the effective rate of the transfers the cluster made.

Prints a table; ``--out`` writes JSON.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from radixserve.bench.local_cluster import LocalCluster
from radixserve.launch.cluster import ClusterConfig

SYSTEM = (
    "You are the support assistant of Northwind Telecom. Be brief and friendly; answer in "
    "at most three sentences. Plans: Basic (10 GB, 15 euros), Plus (50 GB, 25 euros), "
    "Unlimited (35 euros, throttled after 200 GB). Roaming in the EU is included; outside "
    "the EU it costs 5 euros a day. Contracts renew monthly and can be cancelled online "
    "with thirty days notice. Support hours are eight to eight on weekdays and nine to five "
    "on Saturdays. A replacement SIM costs 10 euros and arrives in two working days; eSIM "
    "is free and activates within an hour. Number porting takes one working day. Invoices "
    "are sent on the first of the month and can be paid by card, bank transfer or direct "
    "debit; late payments cost 5 euros. Devices can be bought outright or in 24 monthly "
    "instalments without interest. Insurance covers theft and accidental damage for 6 "
    "euros a month with a 50 euro excess. "
)


def system_prompt(num_stores: int) -> str:
    """The shared system prompt: the policies above plus a store directory of
    ``num_stores`` lines (about 45 tokens each), so its length can be scaled."""
    streets = ["Market", "Station", "Harbour", "Church", "Mill", "Castle", "Garden", "Bridge"]
    lines = [
        f"Store {i + 1}: {streets[i % 8]} Street {10 + 7 * i}, open {8 + i % 3}:00 to "
        f"{18 + i % 4}:00, phone 020 555 {1000 + 37 * i}, repairs {'yes' if i % 3 else 'no'}."
        for i in range(num_stores)
    ]
    return SYSTEM + ("Store directory:\n" + "\n".join(lines) if lines else "")


QUESTIONS = [
    "Hi, I am thinking about switching to you. Which plan fits someone who streams a lot?",
    "What happens if I go over 200 GB on Unlimited?",
    "I travel to Switzerland twice a year. What would roaming cost me there?",
    "Can I keep my current phone number?",
    "How long does porting take, and will I be without service?",
    "Do you offer eSIM? My phone supports it.",
    "If I buy a phone in instalments, is there any interest?",
    "What does the insurance cover, and what is the excess?",
    "How do I pay my invoice, and when is it due?",
    "What if I pay a few days late?",
    "When can I reach support on a Saturday?",
    "Great. How do I cancel if I am not happy after a few months?",
]


def stream_turn(
    client: httpx.Client, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, Any]:
    """One streamed greedy chat completion: client-side TTFT, text and usage."""
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"gateway answered {resp.status_code}: {resp.text}")
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream failed: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                content = choice["delta"].get("content")
                if content and ttft is None:
                    ttft = time.perf_counter() - start
                text.append(content or "")
    return {
        "ttft_ms": (ttft if ttft is not None else time.perf_counter() - start) * 1000.0,
        "text": "".join(text),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
    }


def _run_conversation(
    config: ClusterConfig, system: str, turns: int, max_tokens: int, answers: list[str] | None
) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """Run the chat on a fresh cluster; with ``answers`` given, replay those answers as
    the history (so both runs send the same prompts). Returns per-turn rows, the
    answers, and the decode worker's counters at the end."""
    rows, got = [], []
    messages = [{"role": "system", "content": system}]
    with LocalCluster(config) as cluster, httpx.Client(base_url=cluster.url, timeout=600) as c:
        stream_turn(c, [{"role": "user", "content": "Warm-up: say hi."}], 2)
        for i in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
            row = stream_turn(c, messages, max_tokens)
            answer = answers[i] if answers is not None else row["text"]
            got.append(row["text"])
            messages.append({"role": "assistant", "content": answer})
            rows.append(row)
            print(f"    turn {i + 1}: TTFT {row['ttft_ms']:.1f} ms, cached "
                  f"{row['cached_tokens']}/{row['prompt_tokens']}", file=sys.stderr)  # fmt: skip
        time.sleep(1.0)  # a heartbeat after the last request carries the final counters
        decode = cluster.workers()["decode-0"]
    return rows, got, decode


def _engine_ttfts(
    engine_env: dict[str, str], threads: int, system: str, answers: list[str], max_tokens: int
) -> list[float]:
    """The engine's own TTFT (cache on) for the same prompts, history built the same way."""
    from radixserve.engine.engine import Engine
    from radixserve.engine.sampling_params import SamplingParams
    from radixserve.settings import EngineSettings

    # the cluster's engine settings exactly (dtype, device, pool ...), its thread count
    same: dict[str, object] = {
        k.removeprefix("RADIXSERVE_").lower(): v for k, v in engine_env.items()
    }
    same.update(num_threads=threads, load_progress=False)
    engine = Engine(EngineSettings(**same))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engine.generate([engine.tokenizer.encode_chat([{"role": "user", "content": "Warm-up: say hi."}])],
                    SamplingParams(max_tokens=2, temperature=0.0))  # fmt: skip
    messages = [{"role": "system", "content": system}]
    ttfts = []
    for i, answer in enumerate(answers):
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        [result] = engine.generate([engine.tokenizer.encode_chat(messages)], params)
        ttfts.append(result.ttft_ms)
        messages.append({"role": "assistant", "content": answer})
    return ttfts


def run_gateway_bench(quick: bool = False, out_path: str | None = None) -> int:
    from radixserve.bench.kv_transfer import measure_transfer

    turns, max_tokens, stores = (4, 16, 6) if quick else (12, 48, 28)
    system = system_prompt(stores)
    engine_env = {"RADIXSERVE_KV_CACHE_MEMORY_GIB": "0.5", "RADIXSERVE_DTYPE": "float32",
                  "RADIXSERVE_DEVICE": "cpu"}  # fmt: skip
    threads = max(1, (os.cpu_count() or 1) // 2)

    def config(cache: bool) -> ClusterConfig:
        env = dict(engine_env)
        if not cache:
            env["RADIXSERVE_PREFIX_CACHE"] = "false"
        return ClusterConfig(port=0, engine_env=env, num_threads=threads)

    print("gateway bench: cluster with the prefix cache ON ...", file=sys.stderr)
    on, answers, decode_on = _run_conversation(config(True), system, turns, max_tokens, None)
    print("gateway bench: cluster with the prefix cache OFF ...", file=sys.stderr)
    off, _, decode_off = _run_conversation(config(False), system, turns, max_tokens, answers)
    print("gateway bench: the engine alone (cache on), same prompts ...", file=sys.stderr)
    engine = _engine_ttfts(engine_env, threads, system, answers, max_tokens)
    print("gateway bench: NIXL page reads vs memcpy ...", file=sys.stderr)
    nixl = measure_transfer("nixl", 256, scattered=False)

    rows = []
    for i in range(turns):
        rows.append({
            "turn": i + 1,
            "prompt_tokens": on[i]["prompt_tokens"],
            "cached_tokens_on": on[i]["cached_tokens"],
            "cached_tokens_off": off[i]["cached_tokens"],
            "ttft_on_ms": on[i]["ttft_ms"],
            "ttft_off_ms": off[i]["ttft_ms"],
            "engine_ttft_on_ms": engine[i],
            "gateway_minus_engine_ms": on[i]["ttft_ms"] - engine[i],
        })  # fmt: skip
    cached_turns = rows[1:]
    overhead = statistics.median(r["gateway_minus_engine_ms"] for r in cached_turns)

    def transfers(decode: dict[str, Any]) -> dict[str, Any]:
        moved, seconds = (
            decode.get("kv_transfer_bytes_total", 0),
            decode.get("kv_transfer_seconds_total", 0),
        )
        return {
            "remote_prefills": decode.get("remote_prefills_total", 0),
            "local_prefills": decode.get("local_prefills_total", 0),
            "transfers": decode.get("kv_transfers_total", 0),
            "pages": decode.get("kv_transfer_pages_total", 0),
            "bytes": moved,
            "gbps": moved / seconds / 1e9 if seconds else None,
        }

    result = {
        "scenario": "gateway",
        "preset": "quick" if quick else "full",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": threads},
        "turns": rows,
        "summary": {
            "ttft_cut_last_turn_pct": 100.0
            * (1 - rows[-1]["ttft_on_ms"] / rows[-1]["ttft_off_ms"]),
            "median_gateway_minus_engine_ms": overhead,
            "overhead_target_ms": 15.0,
            "nixl_gbps": nixl["gbps"],
            "memcpy_gbps": nixl["memcpy_gbps"],
            "nixl_fraction_of_memcpy": nixl["fraction_of_memcpy"],
            "cluster_on": transfers(decode_on),
            "cluster_off": transfers(decode_off),
        },
    }
    print(format_table(result))
    if out_path:
        Path(out_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {out_path}", file=sys.stderr)
    return 0


def format_table(r: dict[str, Any]) -> str:
    s = r["summary"]
    lines = [
        f"gateway benchmark ({r['preset']}): a {len(r['turns'])}-turn chat through the cluster "
        f"(1 prefill + 1 decode, NIXL), {r['machine']['threads']} thread(s) per worker",
        "",
        "| turn | prompt | cached (on) | TTFT off (ms) | TTFT on (ms) | on/off | engine on (ms) "
        "| gateway − engine (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in r["turns"]:
        lines.append(
            f"| {t['turn']} | {t['prompt_tokens']} | {t['cached_tokens_on']} | "
            f"{t['ttft_off_ms']:.1f} | {t['ttft_on_ms']:.1f} | "
            f"{100 * t['ttft_on_ms'] / t['ttft_off_ms']:.1f} % | {t['engine_ttft_on_ms']:.1f} | "
            f"{t['gateway_minus_engine_ms']:+.1f} |"
        )
    ok = "✓" if s["median_gateway_minus_engine_ms"] <= s["overhead_target_ms"] else "✗"
    ok_nixl = "✓" if s["nixl_fraction_of_memcpy"] >= 0.5 else "✗"
    lines += [
        "",
        f"cached turns: gateway TTFT − engine TTFT, median {s['median_gateway_minus_engine_ms']:.1f} ms "
        f"(target ≤ {s['overhead_target_ms']:.0f} ms) {ok}",
        f"TTFT cut at the last turn: {s['ttft_cut_last_turn_pct']:.1f} %",
        f"NIXL page reads (256 pages, two processes): {s['nixl_gbps']:.2f} GB/s vs memcpy "
        f"{s['memcpy_gbps']:.2f} GB/s = {100 * s['nixl_fraction_of_memcpy']:.0f} % "
        f"(target ≥ 50 %) {ok_nixl}",
    ]
    for mode in ("on", "off"):
        c = s[f"cluster_{mode}"]
        rate = f"{c['gbps']:.2f} GB/s" if c["gbps"] else "n/a"
        lines.append(
            f"cluster, cache {mode}: {c['remote_prefills']} remote / {c['local_prefills']} local "
            f"prefills; {c['transfers']} transfers moved {c['pages']} pages, effective {rate}"
        )
    return "\n".join(lines)
