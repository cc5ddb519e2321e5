"""The shared tier across nodes (`radixserve bench --scenario shared-tier`, its second and
third parts; docs/architecture.md §9 "One kvstore per node").

**Two nodes** (one machine: two kvstores, decode-0 on node 0 and decode-1 on node 1; for
the host-tier part a second such cluster whose workers write every computed prefix
through to their node's host tier):

- *peer read from the other node*: `shared_tier`'s drained conversation again, its owner
  and its reader now on different nodes;
- *host tier, local vs remote node*: a ~3,000-token prompt computed on one worker (its
  node's host tier holds it); that worker stopped (SIGSTOP: its device out of reach), the
  prompt again goes to the other node's worker, which loads it from the first node's host
  tier (**remote**); the first worker killed and restarted (its device empty) and the
  second stopped, the prompt again goes to the first, which loads it from its own node's
  tier (**local**); then the same prompt under a fresh tag (**recompute**).

**Index shards**: 1 and 3 kvstores alone (no workers), each fed the page hashes of a
turn-4 prompt it owns (hash mod shards) as one worker's; `IndexQuery` round trips, one
after another, each asking every shard at once and waiting for every answer, as a
worker's lookup does (`IndexClient.lookup_tiers`).

On one machine the "nodes" share its loopback: the figures are the machinery's cost
(more kvstores to ask, another node's tier to attach to), not a network's.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import sys
import time
import uuid
from typing import Any

import httpx
import zmq

from radixserve.bench.gateway_chat import stream_turn
from radixserve.bench.local_cluster import LocalCluster, metric_value
from radixserve.bench.report import percentile
from radixserve.cache.block_hash import hash_namespace, page_hashes
from radixserve.launch.cluster import ClusterConfig, kvstore_spec
from radixserve.launch.listeners import Listener
from radixserve.launch.supervisor import Supervisor
from radixserve.model.identity import ModelIdentity
from radixserve.model.model_files import open_model
from radixserve.protocol import Channel, IndexQuery, IndexReply, KVEvent

DECODES = ("decode-0", "decode-1")  # on nodes 0 and 1
KVSTORES = ("kvstore-0", "kvstore-1")
PAGE = 16


def two_node_config(
    model: str, transport: str, linger_s: float, write_through: bool = False
) -> ClusterConfig:
    """Two kvstores, a decode worker on each node computing its prompts itself; with
    ``write_through``, writing each computed prefix through to its node's host tier (for
    the host-tier part: a spill would need an eviction; not for the peer read, whose turn
    it would slow by the copy)."""
    through = {"RADIXSERVE_DECODE_HOST_WRITE_THROUGH_USES": "1"} if write_through else {}
    return ClusterConfig(
        num_prefill=0, num_decode=2, nodes=2, port=0, transport=transport, host_tier_gib=1.0,
        engine_env={"RADIXSERVE_MODEL": model},
        decode_env={"RADIXSERVE_DECODE_LOCAL_PREFILL_MAX_TOKENS": "100000",
                    "RADIXSERVE_DECODE_DRAIN_LINGER_S": f"{linger_s:g}", **through},
    )  # fmt: skip


def _stat(cluster: LocalCluster, name: str, key: str) -> float:
    return float(cluster.worker(name).get(key) or 0)


def _host_tokens(client: httpx.Client) -> float:
    return metric_value(client.get("/metrics").text, "radixserve_cached_tokens_total", tier="host")


def _out_of_reach(cluster: LocalCluster, name: str) -> int:
    """SIGSTOP ``name`` and wait until the gateway has it down; its pid."""
    pid = cluster.supervisor.pid(name)
    assert pid is not None, f"{name} is not running"
    os.kill(pid, signal.SIGSTOP)
    cluster.wait(lambda: not cluster.worker(name)["up"], 60, f"{name} down")
    return pid


def host_tier_pair(
    cluster: LocalCluster, client: httpx.Client, messages: list[dict[str, str]],
    fresh: list[dict[str, str]], probe_tokens: int,
) -> dict[str, Any]:  # fmt: skip
    """One remote and one local host-tier hit of ``messages``' prompt, and ``fresh`` (its
    twin under another tag) computed (see the module notes)."""
    before = {w: _stat(cluster, w, "local_prefills_total") for w in DECODES}
    stored = {k: _stat(cluster, k, "host_stored_pages_total") for k in KVSTORES}
    first = stream_turn(client, messages, 2)
    owner = max(DECODES, key=lambda w: _stat(cluster, w, "local_prefills_total") - before[w])
    reader = DECODES[1 - DECODES.index(owner)]
    home = KVSTORES[DECODES.index(owner)]
    full = first["prompt_tokens"] // PAGE - 1
    cluster.wait(lambda: _stat(cluster, home, "host_stored_pages_total") - stored[home] >= full,
                 30, f"the prompt written through to {home}")  # fmt: skip
    generation = cluster.worker(owner)["generation"]
    pid = _out_of_reach(cluster, owner)
    loads, host = _stat(cluster, reader, "host_remote_loads_total"), _host_tokens(client)
    remote = stream_turn(client, messages, probe_tokens)
    cluster.settled((reader,))  # its counters come with its heartbeats
    remote_loads = _stat(cluster, reader, "host_remote_loads_total") - loads
    remote_host = _host_tokens(client) - host
    os.kill(pid, signal.SIGKILL)  # restarted by the supervisor with an empty device
    cluster.wait_restarted(owner, generation)
    reader_pid = _out_of_reach(cluster, reader)
    try:
        host = _host_tokens(client)
        local = stream_turn(client, messages, probe_tokens)
        local_host = _host_tokens(client) - host
    finally:
        os.kill(reader_pid, signal.SIGCONT)
    cluster.wait(lambda: cluster.worker(reader)["up"], 120, f"{reader} back")
    recompute = stream_turn(client, fresh, probe_tokens)
    row = {
        "owner": owner, "reader": reader, "prompt_tokens": remote["prompt_tokens"],
        "remote_ttft_ms": remote["ttft_ms"], "remote_cached_tokens": remote["cached_tokens"],
        "remote_host_tokens": int(remote_host), "remote_loads": int(remote_loads),
        "local_ttft_ms": local["ttft_ms"], "local_cached_tokens": local["cached_tokens"],
        "local_host_tokens": int(local_host),
        "recompute_ttft_ms": recompute["ttft_ms"],
        "recompute_cached_tokens": recompute["cached_tokens"],
    }  # fmt: skip
    print(f"  host tier: remote node {remote['ttft_ms']:.0f} ms "
          f"({remote['cached_tokens']}/{remote['prompt_tokens']} cached), local node "
          f"{local['ttft_ms']:.0f} ms ({local['cached_tokens']} cached), recompute "
          f"{recompute['ttft_ms']:.0f} ms", file=sys.stderr)  # fmt: skip
    return row


# -- the index, sharded ------------------------------------------------------------------


def prompt_hashes(model: str, identity: ModelIdentity, messages: list[dict[str, str]]) -> list[int]:
    ids = open_model(model).tokenizer.encode_chat(messages)
    return page_hashes(ids, PAGE, hash_namespace(identity.key))


def index_reply(channel: Channel, query_id: str, deadline: float) -> IndexReply:
    """A kvstore's answer to query ``query_id`` by ``deadline`` (it also heartbeats a
    socket that asked it something: those are passed over)."""
    while (left_ms := int(1000 * (deadline - time.monotonic()))) > 0:
        got = channel.recv(timeout_ms=left_ms)
        if isinstance(got, IndexReply) and got.query_id == query_id:
            return got
    raise RuntimeError("a kvstore did not answer an IndexQuery in time")


def index_shards(hashes: list[int], shard_counts: tuple[int, ...], round_trips: int) -> list[dict]:
    """Per shard count, the latency of asking every shard at once (module notes)."""
    results = []
    for count in shard_counts:
        config = ClusterConfig(nodes=count, port=0, engine_env={})
        listeners = [Listener("127.0.0.1", 0) for _ in range(count)]
        for listener in listeners:
            listener.bind()
        specs = [kvstore_spec(config, listener, node) for node, listener in enumerate(listeners)]
        specs = [dataclasses.replace(s, env={**s.env, "RADIXSERVE_KVSTORE_HOST_CAPACITY_GIB": "0"})
                 for s in specs]  # fmt: skip
        supervisor = Supervisor(specs, restart_backoff_s=0.2)
        context = zmq.Context()
        try:
            supervisor.start()
            addresses = [f"tcp://127.0.0.1:{listener.port}" for listener in listeners]
            channels = [Channel.open(context, zmq.DEALER, a, bind=False) for a in addresses]
            results.append(_time_shards(channels, hashes, round_trips))
            for channel in channels:
                channel.close()
        finally:
            context.term()
            supervisor.stop()
    return results


def _time_shards(channels: list[Channel], hashes: list[int], round_trips: int) -> dict[str, Any]:
    count = len(channels)
    worker = f"bench-{uuid.uuid4().hex[:6]}"
    for shard, channel in enumerate(channels):  # one worker holding the whole prompt
        own = tuple(h for h in hashes if h % count == shard)
        channel.send(KVEvent(worker, 1, 1, "stored", own), timeout_ms=5000)
    times: list[float] = []
    held = 0
    deadline = time.monotonic() + 30  # the kvstores start meanwhile
    while held < len(hashes) and time.monotonic() < deadline:  # until every shard knows it
        held = _ask(channels, hashes, time.monotonic() + 5).get(worker, 0)
    if held < len(hashes):
        raise RuntimeError(f"the {count} shard(s) index {held} of {len(hashes)} pages")
    for _ in range(round_trips):
        start = time.perf_counter()
        _ask(channels, hashes, time.monotonic() + 5)
        times.append(1000.0 * (time.perf_counter() - start))
    return {"shards": count, "round_trips": round_trips, "hashes": len(hashes),
            "median_ms": statistics.median(times), "p90_ms": percentile(times, 90),
            "min_ms": min(times)}  # fmt: skip


def _ask(channels: list[Channel], hashes: list[int], deadline: float) -> dict[str, int]:
    """Every shard asked at once; each worker's leading pages over their answers."""
    count, query = len(channels), uuid.uuid4().hex
    for shard, channel in enumerate(channels):
        channel.send(IndexQuery(f"{query}-{shard}", tuple(hashes), shard, count), timeout_ms=5000)
    held: dict[str, int] = {}
    for shard, channel in enumerate(channels):
        for name, pages in index_reply(channel, f"{query}-{shard}", deadline).device_pages.items():
            held[name] = max(held.get(name, 0), int(pages))
    return held
