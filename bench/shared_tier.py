"""`radixserve bench --scenario shared-tier`: a conversation continued on another decode
worker from its drained worker's device cache (peer reads, docs/architecture.md §9),
next to a device hit and to recomputing it; and the kvstore index's query latency.

One cluster: the kvstore (1 GiB host tier), one prefill worker, two decode workers that
compute their prompts themselves (``LOCAL_PREFILL_MAX_TOKENS`` above the conversation),
pages over NIXL (``--transport``), the engine's serving defaults. A warm-up request runs
on each decode worker first. Each conversation (a fresh random tag at the head of a
~3,000-token system prompt, so no run shares another's cache):

1. three turns, which stay on one decode worker (the *owner*: the one whose
   ``local_prefills_total`` grew); the owner is sent SIGTERM: it drains, then lingers
   ``drain_linger_s`` lending its cached pages;
2. **peer read**: turn 4 goes to the other decode worker, which reads the
   conversation's prefix from the lingering owner (its ``peer_read_pages_total`` delta,
   the gateway's ``radixserve_cached_tokens_total{tier="peer"}`` delta, usage's
   ``cached_tokens``);
3. **local hit**: the same turn on a worker that holds the conversation: a twin
   conversation under a fresh tag whose turn 4 stays on the worker of its turns 1-3. It
   finds the same prefix cached and computes the same new tokens past it as the peer turn
   (the end of turn 3's answer and the new question, ~2 pages); only where the cached
   pages come from differs (it runs last, after 4 and 5);
4. the prompt repeated, twice like for like: once the owner is back (restarted by the
   supervisor, its cache empty), the turn-4 prompt again on the worker that now holds
   it (**repeat, local**: all but its last page on the device), then that worker drains
   and the prompt goes to the restarted owner, which reads it from the draining worker
   (**repeat, peer**);
5. **recompute**: the same-length prompt under a fresh tag: nothing cached anywhere.

TTFT is the client's (request sent → first streamed content chunk); the peer, local and
repeated turns carry a ``traceparent``, and the gateway's copy of their trace gives the
worker's admission (the peer read inside it). Then the kvstore
index's latency: ``IndexQuery`` round trips, one after another on one DEALER socket, for
the last turn-4 prompt's page hashes (one index shard: the one kvstore). The table gives
each conversation, the medians, the ratios peer / local hit (both pairings) and peer /
recompute and the share of the prompt cached on the peer turn, beside the judged targets
(printed, not asserted).

Then the same across nodes (`radixserve.bench.shared_tier_nodes`): a cluster of two nodes
(a kvstore each) where the drained conversation is read from the other node, the host
tier's hits from the local and from the remote node beside a recompute, and the index's
latency over 1 and 3 kvstores. JSON goes to ``--out`` (default
``bench/results/shared-tier[-quick].json``); the ratios and tables are
`radixserve.bench.shared_tier_report`'s.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import zmq

from radixserve.bench.gateway_chat import QUESTIONS, stream_turn, system_prompt
from radixserve.bench.local_cluster import LocalCluster, metric_value
from radixserve.bench.peer_report import write_json
from radixserve.bench.report import percentile
from radixserve.bench.shared_tier_nodes import (
    host_tier_pair,
    index_reply,
    index_shards,
    prompt_hashes,
    two_node_config,
)
from radixserve.bench.shared_tier_report import (
    TARGETS,
    TURNS,
    format_table,
    ratios,
    summarise_other_node,
)
from radixserve.cache.block_hash import hash_namespace, page_hashes
from radixserve.launch.cluster import ClusterConfig
from radixserve.model.identity import ModelIdentity
from radixserve.model.model_files import open_model
from radixserve.protocol import Channel, IndexQuery, IndexReply

DECODES = ("decode-0", "decode-1")
PAGE = 16
SYSTEM_TOKENS = 3000
_BASE_TOKENS, _TOKENS_PER_STORE = 221, 45.1  # `system_prompt`'s, with SmolLM2's tokenizer
TURN_TOKENS = 16  # the answers of turns 1-3 (they join the history)
PROBE_TOKENS = 4  # the measured turns: TTFT is the subject
LINGER_S = 10.0  # drain_linger_s (the default), stated to the workers and in the JSON
#: the reader's peer-read counters (`PeerReadSection`) recorded per peer turn
READER_COUNTERS = ("peer_read_asks_total", "peer_reads_total", "peer_read_pages_total",
                   "peer_read_bytes_total", "peer_read_refusals_total",
                   "peer_reads_skipped_total", "peer_read_failures_total",
                   "peer_read_seconds_total", "peer_read_connects_total")  # fmt: skip
#: (conversations, index round trips) per preset
PRESETS = {"quick": (1, 50), "full": (3, 200)}


def conversation(tag: str, answers: list[str], turns: int) -> list[dict[str, str]]:
    """``turns`` user turns over a ~3,000-token system prompt headed by ``tag``, the
    earlier turns answered by ``answers``."""
    stores = round((SYSTEM_TOKENS - _BASE_TOKENS) / _TOKENS_PER_STORE)
    messages = [{"role": "system", "content": f"[{tag}] " + system_prompt(stores)}]
    for i in range(turns):
        if i:
            messages.append({"role": "assistant", "content": answers[i - 1]})
        messages.append({"role": "user", "content": QUESTIONS[i]})
    return messages


def _tag() -> str:
    return uuid.uuid4().hex[:8]


def _settled(cluster: LocalCluster, names: tuple[str, ...] = DECODES) -> dict[str, dict]:
    """`LocalCluster.settled`, of the decode workers by default."""
    return cluster.settled(names)


def _count(workers: dict[str, dict], name: str, key: str) -> float:
    return float(workers.get(name, {}).get(key, 0) or 0)


def _warm_up(cluster: LocalCluster, client: httpx.Client) -> None:
    """One short request on each decode worker (sent together, the gateway spreads them
    by load) until both have served one."""
    before = _settled(cluster)
    for _ in range(5):
        asks = [threading.Thread(target=stream_turn, args=(client, [
            {"role": "user", "content": f"Warm-up {_tag()}: say hi."}], 2)) for _ in DECODES]  # fmt: skip
        for t in asks:
            t.start()
        for t in asks:
            t.join()
        after = _settled(cluster)
        if all(_count(after, n, "local_prefills_total") > _count(before, n, "local_prefills_total")
               for n in DECODES):  # fmt: skip
            return
    print("  warning: the warm-up did not reach both decode workers", file=sys.stderr)


def _peer_tokens(client: httpx.Client) -> float:
    return metric_value(client.get("/metrics").text, "radixserve_cached_tokens_total", tier="peer")


def _traced_turn(
    cluster: LocalCluster, client: httpx.Client, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, Any]:
    """`stream_turn` under a ``traceparent`` of our own, with where the worker's part of
    the TTFT went from the gateway's copy of the trace (``queue_ms``: the gateway's
    parse, tokenise and route; ``admission_ms``: the worker's admission, a peer read
    included; ``peer_read_span_ms``: the index query, the ask and the read; None where the
    gateway keeps no trace)."""
    trace_id = uuid.uuid4().hex
    client.headers["traceparent"] = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
    try:
        got = stream_turn(client, messages, max_tokens)
    finally:
        del client.headers["traceparent"]
    spans: dict[str, float] = {}

    def kept() -> bool:  # the trace enters the store once the response has been sent
        resp = client.get(f"/debug/traces/{trace_id}")
        if resp.status_code == 200:
            spans.update({s["name"]: (s["end_ns"] - s["start_ns"]) / 1e6
                          for s in resp.json()["spans"] if s["end_ns"]})  # fmt: skip
        return "decode.admission" in spans

    # no trace within 3 s: the gateway keeps none (trace_buffer 0); the TTFT stands alone
    with contextlib.suppress(TimeoutError):
        cluster.wait(kept, 3, "the turn's trace")
    return {**got, "queue_ms": spans.get("gateway.queue"),
            "admission_ms": spans.get("decode.admission"),
            "peer_read_span_ms": spans.get("decode.peer_read")}  # fmt: skip


def _one_conversation(cluster: LocalCluster, client: httpx.Client, n: int) -> dict[str, Any]:
    tag = _tag()
    before = _settled(cluster)
    answers: list[str] = []
    turns = []
    for turn in (1, 2, 3):
        got = stream_turn(client, conversation(tag, answers, turn), TURN_TOKENS)
        answers.append(got["text"])
        turns.append(got)
    after = _settled(cluster)
    prefills = {w: _count(after, w, "local_prefills_total") - _count(before, w, "local_prefills_total")
                for w in DECODES}  # fmt: skip
    owner = max(DECODES, key=lambda w: prefills[w])
    reader = DECODES[1 - DECODES.index(owner)]
    generation = _drain(cluster, owner)

    messages = conversation(tag, answers, 4)
    peer_before = _peer_tokens(client)
    peer = _traced_turn(cluster, client, messages, PROBE_TOKENS)
    peer_tier = _peer_tokens(client) - peer_before
    read = _settled(cluster, (reader,))
    counters = {k: _count(read, reader, k) - _count(after, reader, k) for k in READER_COUNTERS}
    # the owner leaves once it has lingered and is started again (its cache empty): the
    # repeats and the recompute run on a quiet machine
    cluster.wait_restarted(owner, generation, LINGER_S + 120)
    repeat = _traced_turn(cluster, client, messages, PROBE_TOKENS)
    # the same repeat once more, now from a peer: the reader (which holds the prompt)
    # drains, and the owner, back with its cache empty, reads the prompt from it
    generation = _drain(cluster, reader)
    peer_before = _peer_tokens(client)
    repeat_peer = _traced_turn(cluster, client, messages, PROBE_TOKENS)
    repeat_peer["peer_tier_tokens"] = int(_peer_tokens(client) - peer_before)
    cluster.wait_restarted(reader, generation, LINGER_S + 120)
    recompute = stream_turn(client, conversation(_tag(), answers, 4), PROBE_TOKENS)
    local = _local_turn(cluster, client)
    row = {
        "conversation": n + 1,
        "owner": owner,
        "reader": reader,
        "owner_turns": int(prefills[owner]),
        "turn_ttft_ms": [t["ttft_ms"] for t in turns],
        "prompt_tokens": peer["prompt_tokens"],
        "peer_ttft_ms": peer["ttft_ms"],
        "peer_cached_tokens": peer["cached_tokens"],
        "peer_tier_tokens": int(peer_tier),
        "peer_read_pages": int(counters["peer_read_pages_total"]),
        "peer_read_bytes": int(counters["peer_read_bytes_total"]),
        "peer_read_ms": 1000.0 * counters["peer_read_seconds_total"],
        "peer_admission_ms": peer["admission_ms"],
        "peer_read_span_ms": peer["peer_read_span_ms"],
        "peer_queue_ms": peer["queue_ms"],
        "reader_counters": {k: counters[k] for k in READER_COUNTERS},
        **_turn_fields("local", local),
        **_turn_fields("repeat", repeat),
        **_turn_fields("repeat_peer", repeat_peer),
        "repeat_peer_tier_tokens": repeat_peer["peer_tier_tokens"],
        "recompute_ttft_ms": recompute["ttft_ms"],
        "recompute_prompt_tokens": recompute["prompt_tokens"],
        "recompute_cached_tokens": recompute["cached_tokens"],
        "messages": messages,  # the last one's prompt is what the index is asked about
    }
    print(f"  conversation {n + 1}: {owner} drained, {reader}: peer {peer['ttft_ms']:.0f} ms "
          f"({peer['cached_tokens']}/{peer['prompt_tokens']} cached, "
          f"{row['peer_read_pages']} pages read), local hit (the same turn on its own "
          f"worker) {local['ttft_ms']:.0f} ms; the prompt repeated: from a peer "
          f"{repeat_peer['ttft_ms']:.0f} ms, local {repeat['ttft_ms']:.0f} ms; recompute "
          f"{recompute['ttft_ms']:.0f} ms", file=sys.stderr)  # fmt: skip
    return row


def _drain(cluster: LocalCluster, worker: str) -> int:
    """Send ``worker`` SIGTERM (it drains, then lingers lending its pages) once it is
    draining; its generation before, for `LocalCluster.wait_restarted`."""
    pid = cluster.supervisor.pid(worker)
    assert pid is not None, f"{worker} is not running"
    generation = _settled(cluster, (worker,))[worker]["generation"]
    os.kill(pid, signal.SIGTERM)
    cluster.wait(lambda: cluster.worker(worker).get("draining"), 30, f"{worker} to drain")
    return generation


def _turn_fields(name: str, turn: dict[str, Any]) -> dict[str, Any]:
    return {f"{name}_ttft_ms": turn["ttft_ms"], f"{name}_prompt_tokens": turn["prompt_tokens"],
            f"{name}_cached_tokens": turn["cached_tokens"],
            f"{name}_admission_ms": turn["admission_ms"]}  # fmt: skip


def _local_turn(cluster: LocalCluster, client: httpx.Client) -> dict[str, Any]:
    """The local device hit of the same turn: a twin conversation (a fresh tag, its own
    answers) whose turn 4 stays on the worker of its turns 1-3 (no drain). It finds the
    same prefix cached and computes the same new tokens as the peer turn (the end of
    turn 3's answer and the new question); only where the cached pages come from differs."""
    tag = _tag()
    answers: list[str] = []
    for turn in (1, 2, 3):
        answers.append(stream_turn(client, conversation(tag, answers, turn), TURN_TOKENS)["text"])
    return _traced_turn(cluster, client, conversation(tag, answers, 4), PROBE_TOKENS)


def served_identity(cluster: LocalCluster) -> ModelIdentity:
    """The identity of the weights the cluster serves (its pages' hash namespace)."""
    view = cluster.debug_cache()
    cards = [view.get("model_identity")] + [w.get("model_identity")
                                            for w in view["workers"].values()]  # fmt: skip
    card = next(c for c in cards if c and "weights" in c)
    return ModelIdentity(card["weights"], card["quantization"], card["dtype"], card["adapter"])


def index_latency(
    cluster: LocalCluster, model: str, messages: list[dict[str, str]], round_trips: int
) -> dict[str, Any]:
    """``round_trips`` `IndexQuery` round trips for the page hashes of ``messages``'
    prompt, one after another on one socket (one untimed first); their latency."""
    address = cluster.debug_cache()["workers"]["kvstore"]["address"]
    identity = served_identity(cluster)
    ids = open_model(model).tokenizer.encode_chat(messages)
    hashes = tuple(page_hashes(ids, PAGE, hash_namespace(identity.key)))
    context = zmq.Context()
    times: list[float] = []
    reply: IndexReply | None = None
    try:
        with Channel.open(context, zmq.DEALER, address, bind=False) as channel:
            for i in range(round_trips + 1):
                query_id = uuid.uuid4().hex
                start = time.perf_counter()
                channel.send(IndexQuery(query_id, hashes), timeout_ms=2000)
                reply = index_reply(channel, query_id, time.monotonic() + 2.0)
                elapsed = time.perf_counter() - start
                if i:
                    times.append(1000.0 * elapsed)
    finally:
        context.term()
    assert reply is not None
    return {
        "shards": 1,
        "round_trips": round_trips,
        "prompt_tokens": len(ids),
        "hashes": len(hashes),
        "median_ms": statistics.median(times),
        "p90_ms": percentile(times, 90),
        "min_ms": min(times),
        "device_pages": {k: int(v) for k, v in reply.device_pages.items()},
        "host_pages": reply.host_pages,
    }


def run_shared_tier_bench(
    quick: bool = False,
    out_path: str | None = None,
    model: str = "default",
    transport: str = "nixl",
    conversations: int | None = None,
) -> int:
    """``model``: the checkpoint served (``--model``); ``conversations``: how many
    (default 3; quick 1)."""
    preset = "quick" if quick else "full"
    count, round_trips = PRESETS[preset]
    count = conversations or count
    config = ClusterConfig(
        num_prefill=1, num_decode=2, port=0, transport=transport, host_tier_gib=1.0,
        engine_env={"RADIXSERVE_MODEL": model},
        decode_env={"RADIXSERVE_DECODE_LOCAL_PREFILL_MAX_TOKENS": "100000",
                    "RADIXSERVE_DECODE_DRAIN_LINGER_S": f"{LINGER_S:g}"},
    )  # fmt: skip
    print(f"shared-tier bench: {count} conversation(s) of a ~{SYSTEM_TOKENS}-token system "
          f"prompt, 2 decode workers + 1 prefill worker over {transport} ...",
          file=sys.stderr)  # fmt: skip
    rows: list[dict[str, Any]] = []
    with LocalCluster(config) as cluster, httpx.Client(base_url=cluster.url, timeout=900) as c:
        _warm_up(cluster, c)
        for n in range(count):
            rows.append(_one_conversation(cluster, c, n))
        index = index_latency(cluster, model, rows[-1]["messages"], round_trips)
        identity = served_identity(cluster)
    print("shared-tier bench: two nodes (a kvstore each, decode-0 and decode-1 apart) ...",
          file=sys.stderr)  # fmt: skip
    other: list[dict[str, Any]] = []
    hosts: list[dict[str, Any]] = []
    nodes = two_node_config(model, transport, LINGER_S)
    with LocalCluster(nodes) as cluster, httpx.Client(base_url=cluster.url, timeout=900) as c:
        _warm_up(cluster, c)
        for n in range(count):
            other.append(_one_conversation(cluster, c, n))
    nodes = two_node_config(model, transport, LINGER_S, write_through=True)
    with LocalCluster(nodes) as cluster, httpx.Client(base_url=cluster.url, timeout=900) as c:
        _warm_up(cluster, c)
        for _ in range(count):
            hosts.append(host_tier_pair(cluster, c, conversation(_tag(), [], 1),
                                        conversation(_tag(), [], 1), PROBE_TOKENS))  # fmt: skip
    print("shared-tier bench: the index over 1 and 3 kvstores ...", file=sys.stderr)
    shards = index_shards(prompt_hashes(model, identity, rows[-1]["messages"]), (1, 3),
                          round_trips)  # fmt: skip
    for row in rows + other:
        del row["messages"]
    result = summarise(rows, index, preset, model, transport)
    result["other_node"] = summarise_other_node(other, hosts, shards)
    print(format_table(result))
    out = Path(out_path or f"bench/results/shared-tier{'-quick' if quick else ''}.json")
    write_json(result, out)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def summarise(
    rows: list[dict[str, Any]], index: dict[str, Any], preset: str, model: str, transport: str
) -> dict[str, Any]:
    """The run's JSON: its rows, the medians, the ratios and the targets."""

    def median(key: str) -> float:
        return float(statistics.median(row[key] for row in rows))

    med = {k: median(f"{k}_ttft_ms") for k in TURNS}
    shares = [row["peer_cached_tokens"] / max(1, row["prompt_tokens"]) for row in rows]
    return {
        "scenario": "shared-tier",
        "preset": preset,
        "model": model,
        "transport": transport,
        "system_tokens": SYSTEM_TOKENS,
        "drain_linger_s": LINGER_S,
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor(),
            "load_average": list(os.getloadavg()),
        },  # fmt: skip
        "rows": rows,
        "median_ms": med,
        **ratios(med),
        "peer_cached_share": min(shares),
        "peer_read_pages": sum(row["peer_read_pages"] for row in rows),
        "targets": TARGETS,
        "index_query": index,
    }
