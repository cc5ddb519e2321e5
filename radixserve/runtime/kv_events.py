"""A worker's radix-cache events, and the kvstore's tiers', in vLLM's KV-events format
(`KVEventPublisher`).

Routers and indexers built for vLLM (``vllm.distributed.kv_events``) subscribe to a
worker's ZMQ PUB socket (``RADIXSERVE_{PREFILL,DECODE}_KV_EVENTS_ENDPOINT``) and to the
kvstore's (``RADIXSERVE_KVSTORE_KV_EVENTS_ENDPOINT``). Every message is three frames::

    [topic, sequence (8 bytes, big-endian), msgpack EventBatch]

    EventBatch       = [ts (float, Unix seconds), [event, ...], data_parallel_rank (0)]
    BlockStored      = ["BlockStored", block_hashes, parent_block_hash, token_ids,
                        block_size, lora_id (nil), medium]
    BlockRemoved     = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

the array-like, tagged msgspec structs of vLLM 0.10 (``array_like=True, tag=True``),
written here with msgpack (the project's wire library) since the layout is fixed. A
block is a page (``block_size`` = page size); its hash is radixserve's 128-bit chained
page hash (`radixserve.cache.block_hash`) as 16 big-endian bytes (vLLM's hashes are
``bytes | int``), so a subscriber that knows the namespace recomputes it from
``token_ids`` and ``parent_block_hash``. ``medium`` says where the pages are:

    "GPU"   a worker's own pool, the engine's, which vLLM calls GPU whatever the device
            (on a CPU worker it is host memory); a worker publishes these
    "CPU"   the kvstore's host tier          } the kvstore publishes these
    "DISK"  the kvstore's disk tier          } (`radixserve.services.kvstore.tier_events`)

The first batch after start is ``AllBlocksCleared``: a restarted worker's cache is empty
(and a restarted kvstore's host tier; the pages its disk tier adopts follow it).

Sequence numbers count batches from 0. A subscriber that sees a gap sends the first
sequence it lacks (8 bytes, big-endian) to the ROUTER socket at
``..._KV_EVENTS_REPLAY_ENDPOINT`` (with an empty delimiter frame, as a REQ or DEALER
does) and gets every buffered batch from there on as ``[sequence, payload]``, then
``[-1 (8 bytes, signed), b""]``. The buffer keeps ``..._KV_EVENTS_BUFFER_STEPS`` batches.

The cache reports pages on the engine thread (`RadixCache.set_block_listener`; the
kvstore's tiers on its event loop, `publish`); they wait in a queue for the publisher's
own thread, which owns both sockets and sends whatever has queued as one batch (the
engine thread and the kvstore's loop never wait on a socket).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

from radixserve.cache.block_hash import HASH_BYTES
from radixserve.runtime.settings import KVEventsSettings

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # a worker's own pool
MEDIUM_CPU = "CPU"  # the kvstore's host tier
MEDIUM_DISK = "DISK"  # the kvstore's disk tier
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_BATCH_EVENTS = 1024  # events per batch, at most


def block_hash(value: int) -> bytes:
    """A page hash as vLLM's ``bytes`` block hash: 16 bytes, big-endian."""
    return value.to_bytes(HASH_BYTES, "big")


def block_stored(
    hashes: list[int], parent: int | None, tokens: list[int], page_size: int,
    medium: str = MEDIUM_GPU,
) -> list:  # fmt: skip
    return ["BlockStored", [block_hash(h) for h in hashes],
            None if parent is None else block_hash(parent), tokens, page_size, None, medium]  # fmt: skip


def block_removed(hashes: list[int], medium: str = MEDIUM_GPU) -> list:
    return ["BlockRemoved", [block_hash(h) for h in hashes], medium]


def event_batch(events: list[list], ts: float | None = None) -> bytes:
    """One EventBatch, msgpack-encoded."""
    return msgpack.packb([time.time() if ts is None else ts, events, 0], use_bin_type=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard host, ipc:// and inproc://; connect anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The PUB and replay sockets of one worker (or the kvstore), served by a thread of
    their own."""

    def __init__(self, settings: KVEventsSettings, page_size: int = 0) -> None:
        """``page_size``: the worker's, for `on_block` (the kvstore's events carry their
        own, `publish`)."""
        assert settings.kv_events_endpoint is not None
        self.page_size = page_size
        self._topic = settings.kv_events_topic.encode()
        self._queue: queue.SimpleQueue[list | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.kv_events_buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(settings.kv_events_hwm)
        self._replay: zmq.Socket | None = None
        try:
            if binds(settings.kv_events_endpoint):
                self._pub.bind(settings.kv_events_endpoint)
            else:
                self._pub.connect(settings.kv_events_endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if settings.kv_events_replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(settings.kv_events_replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.num_batches = 0
        self._queue.put(["AllBlocksCleared"])
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def on_block(self, kind: str, hashes: list[int], parent: int | None, tokens: list[int]) -> None:
        """The radix cache's listener (`RadixCache.set_block_listener`; engine thread)."""
        if kind == "stored":
            self._queue.put(block_stored(hashes, parent, tokens, self.page_size))
        else:
            self._queue.put(block_removed(hashes))

    def publish(self, event: list) -> None:
        """Queue one event (`block_stored`, `block_removed`) for the next batch; any
        thread, never waits."""
        self._queue.put(event)

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self._queue.put(None)
        self._thread.join(5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay(self._replay)
                except zmq.ZMQError:
                    logger.exception("kv events: a replay request failed")
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            events: list[Any] = []
            item: list | None = first
            while item is not None:
                events.append(item)
                if len(events) >= MAX_BATCH_EVENTS:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if events:
                self._send(events)
            if item is None:
                return

    def _send(self, events: list[Any]) -> None:
        seq, payload = self.num_batches, event_batch(events)
        self.num_batches += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):  # past the high-water mark: dropped, replayable
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    def _answer_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: a replay request of %d frames refused", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))
