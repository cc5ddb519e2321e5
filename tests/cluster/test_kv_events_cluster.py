"""A decode worker's KV events in vLLM's format (`radixserve.runtime.kv_events`), read by
a subscriber written from that format alone (ZMQ SUB + DEALER, msgpack):

* every ``BlockStored``'s token ids rehash (with its parent hash, in the model's
  namespace) to its block hashes, and the chains the events say the worker holds are
  the pages the kvstore's index says it holds;
* a pool too small for every prompt evicts: ``BlockRemoved`` names pages stored before,
  and the index no longer has them;
* the batches published before the subscriber connected (the first is
  ``AllBlocksCleared``) come back through the replay socket, byte for byte as the live
  ones where both have them, and end with the -1 marker.

The kvstore's tiers publish the same way (`radixserve.services.kvstore.tier_events`): a
device pool too small for the conversations spills into a host tier too small for them,
which evicts into a disk tier too small for them, and the kvstore's subscriber sees
``BlockStored`` medium ``"CPU"`` for the spilled pages and ``"DISK"`` for the pages
written to disk (every one rehashing from its tokens), ``BlockRemoved`` from both tiers,
and the chains the events say the tiers hold are the run the kvstore's index offers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from radixserve.cache.block_hash import hash_namespace, page_hashes
from radixserve.model.identity import ModelIdentity
from tests.cluster.cluster_helpers import TestCluster, index_query
from tests.cluster.prompts import QUESTIONS, chat
from tests.cluster.test_host_tier import DEVICE_PAGES, PAGE, branch_system, gib, tiers_env

pytestmark = pytest.mark.timeout(600)

TOPIC = b"kv@decode-0"


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]], int]:
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    return ts, events, rank


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Every buffered batch from ``start`` on, as the replay socket answers a DEALER."""
    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(30_000), "the replay socket did not answer"
            _, seq, payload = sock.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                assert payload == b""
                return out
            out.append((number, payload))
    finally:
        context.destroy(linger=0)


def namespace(cluster: TestCluster) -> bytes:
    card = next(w["model_identity"] for w in cluster.workers().values()
                if w.get("model_identity"))  # fmt: skip
    identity = ModelIdentity(card["weights"], card["quantization"], card["dtype"], card["adapter"])
    return hash_namespace(identity.key)


def chain_tokens(blocks: dict[int, tuple[int | None, list[int]]], last: int) -> list[int]:
    """The prompt prefix ending in block ``last``: its ancestors' tokens, then its own."""
    parts = []
    at: int | None = last
    while at is not None:
        parent, tokens = blocks[at]
        parts.append(tokens)
        at = parent
    return [t for part in reversed(parts) for t in part]


def test_kv_events_in_vllms_format(tiny_model: str, tmp_path: Path) -> None:
    events_at, replay_at = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    cluster = TestCluster(
        transport="zmq", model=tiny_model, kv_cache_memory_gib=0.0005,  # 128 pages
        decode={"KV_EVENTS_ENDPOINT": events_at, "KV_EVENTS_REPLAY_ENDPOINT": replay_at,
                "KV_EVENTS_TOPIC": TOPIC.decode()},
    )  # fmt: skip
    context = zmq.Context()
    try:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(events_at)
        for i in range(24):  # ~10 pages each: past the pool, so older prompts are evicted
            words = " ".join(f"w{i}x{j}" for j in range(40))
            cluster.ask([{"role": "user", "content": f"Prompt {i}: {words}"}], max_tokens=2)
        cluster.wait_clean()
        replayed = replay(replay_at, 0)
        assert [seq for seq, _ in replayed] == list(range(len(replayed)))
        last = replayed[-1][0]
        live: dict[int, bytes] = {}
        while last not in live:
            assert sub.poll(30_000), f"no live batch after {sorted(live)[-1:]}"
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC and len(seq) == 8
            live[int.from_bytes(seq, "big")] = payload
        first_live = min(live)
        assert first_live >= 1  # batch 0 went out before the subscriber connected
        assert sorted(live) == list(range(first_live, last + 1))
        assert all(live[seq] == payload for seq, payload in replayed if seq >= first_live)
        batches = [decode_batch(payload) for _, payload in replayed]
        assert batches[0][1] == [["AllBlocksCleared"]] and batches[0][2] == 0

        ns = namespace(cluster)
        blocks: dict[int, tuple[int | None, list[int]]] = {}
        held: set[int] = set()
        removed: list[int] = []
        for _, events, _ in batches:
            for event in events:
                if event[0] == "BlockStored":
                    _, hashes, parent, tokens, block_size, lora_id, medium = event
                    assert (block_size, lora_id, medium) == (16, None, "GPU")
                    parent_hash = None if parent is None else int.from_bytes(parent, "big")
                    ints = [int.from_bytes(h, "big") for h in hashes]
                    assert page_hashes(tokens, block_size, ns, parent_hash) == ints
                    for k, h in enumerate(ints):
                        blocks[h] = (parent_hash if k == 0 else ints[k - 1],
                                     tokens[k * block_size : (k + 1) * block_size])  # fmt: skip
                    held.update(ints)
                elif event[0] == "BlockRemoved":
                    _, hashes, medium = event
                    ints = [int.from_bytes(h, "big") for h in hashes]
                    assert medium == "GPU" and set(ints) <= held
                    held.difference_update(ints)
                    removed.extend(ints)
        assert removed, "the pool never evicted"
        assert held

        def pages_at_kvstore(tokens: list[int]) -> int:
            reply = index_query(cluster, tokens)
            assert reply is not None
            return int(reply.device_pages.get("decode-0", 0))

        # a held chain: the kvstore's index has every page of it on decode-0
        leaf = next(h for h in held if not any(p == h for p, _ in blocks.values()))
        tokens = chain_tokens(blocks, leaf)
        assert pages_at_kvstore(tokens) == len(tokens) // 16
        # an evicted page: the index has its chain only up to the page before it at most
        gone = next(h for h in removed if h not in held)
        tokens = chain_tokens(blocks, gone)
        assert pages_at_kvstore(tokens) < len(tokens) // 16
    finally:
        context.destroy(linger=0)
        cluster.stop()


class TierFeed:
    """The kvstore's events as a subscriber keeps them: live batches from a SUB socket,
    the ones before it connected from the replay socket, and what each medium holds."""

    def __init__(self, context: zmq.Context, events_at: str, replay_at: str, ns: bytes) -> None:
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(events_at)
        self.replay_at, self.ns = replay_at, ns
        self.live: dict[int, bytes] = {}
        self.early: list[tuple[int, bytes]] = []  # replayed: before the first live batch

    def pump(self, wait_ms: int) -> None:
        """Take the live batches that arrive within ``wait_ms`` (and those queued)."""
        while self.sub.poll(wait_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            self.live[int.from_bytes(seq, "big")] = payload
            wait_ms = 0

    def batches(self) -> list[tuple[float, list[list[Any]], int]]:
        """Every batch so far, in order (replaying those before the first live one)."""
        if not self.live:
            return []
        first = min(self.live)
        if len(self.early) < first:
            self.early = replay(self.replay_at, 0)[:first]
            assert [seq for seq, _ in self.early] == list(range(first))
            # the replay socket's copies are the live ones, byte for byte
            tail = replay(self.replay_at, first)
            assert all(self.live[seq] == payload for seq, payload in tail if seq in self.live)
        assert sorted(self.live) == list(range(first, max(self.live) + 1)), "a live gap"
        ordered = [payload for _, payload in self.early] + [self.live[k] for k in sorted(self.live)]
        return [decode_batch(payload) for payload in ordered]

    def state(self) -> tuple[dict[str, set[int]], dict[str, int], dict[str, int], dict]:
        """Per medium: the pages held, how many were stored and removed; and every page
        stored (hash -> (parent, tokens)), each ``BlockStored`` rehashed from its tokens."""
        held: dict[str, set[int]] = {"CPU": set(), "DISK": set()}
        stored = dict.fromkeys(held, 0)
        removed = dict.fromkeys(held, 0)
        blocks: dict[int, tuple[int | None, list[int]]] = {}
        for k, (_, events, rank) in enumerate(self.batches()):
            assert rank == 0
            if k == 0:
                assert events[0] == ["AllBlocksCleared"]  # first after the start
            for event in events:
                if event[0] == "BlockStored":
                    _, hashes, parent, tokens, size, lora_id, medium = event
                    assert (size, lora_id) == (PAGE, None) and medium in held, event[4:]
                    parent_hash = None if parent is None else int.from_bytes(parent, "big")
                    ints = [int.from_bytes(h, "big") for h in hashes]
                    assert page_hashes(tokens, size, self.ns, parent_hash) == ints
                    for i, h in enumerate(ints):
                        blocks[h] = (parent_hash if i == 0 else ints[i - 1],
                                     tokens[i * size : (i + 1) * size])  # fmt: skip
                    held[medium].update(ints)
                    stored[medium] += len(ints)
                elif event[0] == "BlockRemoved":
                    _, hashes, medium = event
                    ints = {int.from_bytes(h, "big") for h in hashes}
                    assert ints <= held[medium], f"{medium} removed a page it never stored"
                    held[medium] -= ints
                    removed[medium] += len(ints)
                else:
                    assert event == ["AllBlocksCleared"] and k == 0, event
        return held, stored, removed, blocks


def test_the_kvstores_tiers_publish_their_pages(tiny_model: str, tmp_path: Path) -> None:
    events_at, replay_at = f"ipc://{tmp_path}/tier-events", f"ipc://{tmp_path}/tier-replay"
    host_pages = 20  # less than the conversations: the host tier evicts to disk
    cluster = TestCluster(
        transport="zmq", model=tiny_model, kv_cache_memory_gib=gib(DEVICE_PAGES),
        kvstore={**tiers_env(host_pages, tmp_path / "disk", 24),  # 8 slots: it evicts too
                 "KV_EVENTS_ENDPOINT": events_at, "KV_EVENTS_REPLAY_ENDPOINT": replay_at},
    )  # fmt: skip
    context = zmq.Context()
    try:
        cluster.wait_host_tier()  # spills before the attach would be dropped
        feed = TierFeed(context, events_at, replay_at, namespace(cluster))
        for i in range(6):  # 17 pages each: past the device pools, the host and disk tiers
            cluster.ask(chat(QUESTIONS[i], branch_system(i)), max_tokens=2)
        cluster.wait_clean()

        def seen() -> bool:
            feed.pump(200)
            _, stored, removed, _ = feed.state()
            return all(stored.values()) and all(removed.values())

        cluster.wait(seen, 60, "pages stored in and removed from both tiers")

        def chain(last: int, blocks: dict) -> list[int]:
            """``last`` and the pages before it that were stored, first first."""
            out = [last]
            while (parent := blocks[out[-1]][0]) in blocks:
                out.append(parent)
            return out[::-1]

        def agrees() -> bool:
            """The events count what the tiers' stats count, and a chain the events say
            the tiers hold (from its first page, each in host memory or on disk) is the
            run the kvstore's index offers for its tokens."""
            feed.pump(200)
            held, stored, removed, blocks = feed.state()
            store = cluster.workers()["kvstore"]
            counted = (store["host_stored_pages_total"], store["host_evictions_total"],
                       store["disk_write_pages_total"], store["disk_evictions_total"])  # fmt: skip
            if (stored["CPU"], removed["CPU"], stored["DISK"], removed["DISK"]) != counted:
                return False
            tiers = held["CPU"] | held["DISK"]
            chains = [c for c in (chain(h, blocks) for h in tiers)
                      if set(c) <= tiers and blocks[c[0]][0] is None]  # fmt: skip
            if not chains:
                return False
            longest = max(chains, key=len)
            tokens = [t for h in longest for t in blocks[h][1]]
            reply = index_query(cluster, tokens)
            return reply is not None and reply.host_pages == len(longest)

        cluster.wait(agrees, 30, "the events to agree with the tiers' stats and index")
    finally:
        context.destroy(linger=0)
        cluster.stop()
