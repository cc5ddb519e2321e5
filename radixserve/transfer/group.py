"""A worker's transfer agent across its tensor-parallel ranks.

A worker of TP size N keeps its KV pool split over N processes, each rank's pool holding
some of the model's KV heads (`KVShard`), and each rank has its own `KVTransferAgent` on
its own pool. `GroupAgent` is the worker's single agent: it lives in rank 0, holds rank
0's agent, and drives the other ranks' agents (`rank_agent.serve_rank`, a thread in each
rank process) over one ZMQ socket on an ipc path. Services use it as they would one agent;
a TP=1 worker's group is rank 0's agent alone.

* **Metadata** is every rank's agent metadata in rank order (`group_metadata`); one
  agent's metadata is read as a group of one (the kvstore's host pool is one).
* **add_peer** checks that the two TP sizes can exchange pages (`tp_pair_error`: equal,
  or one divides the other; otherwise `TransferError` naming both) and gives each of our
  ranks the peer ranks that hold its heads (`head_sources`).
* **read_pages** has each of our ranks read its heads from those peer ranks: one read
  per rank pair. The group's read is done when every rank's read is, and failed if any
  failed; a dead rank process fails it by its deadline.
* **grants** (`enforce_grants`, `grant`, `revoke`) go to every rank's agent and are
  awaited (`_ask_all`): the reader, told of the pages over the network once the call
  returns, reads from the ranks directly, and a read that overtook its grant would be
  refused.
* **serve_reads** drives every rank's side of peers' reads (NIXL without a progress
  thread progresses only inside agent calls): rank 0's directly, the others' for the
  next `SERVE_S` after each call.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from radixserve.protocol.security import ClusterKeys
from radixserve.transfer.base import KVTransferAgent, TransferError, TransferHandle, read_metadata
from radixserve.transfer.shards import KVShard, head_sources, tp_pair_error
from radixserve.transfer.waits import EventLoopWaits, TransferState

logger = logging.getLogger(__name__)

SERVE_S = 0.05  # how long a rank drives its agent after rank 0's last serve_reads
START_TIMEOUT_S = 60.0  # for every rank's agent to report


def group_metadata(ranks: list[bytes], keys: ClusterKeys | None) -> bytes:
    """The metadata of a group whose ranks' agents have metadata ``ranks`` (rank order)."""
    packed: bytes = msgpack.packb({"tp_group": ranks}, use_bin_type=True)
    return keys.sign(packed) if keys is not None else packed


def split_metadata(metadata: bytes, keys: ClusterKeys | None) -> list[bytes]:
    """Each rank's agent metadata from a group's (or one agent's) ``metadata``."""
    env = read_metadata(metadata, keys, lambda env: env)
    if isinstance(env, dict) and "tp_group" in env:
        ranks = env["tp_group"]
        if not isinstance(ranks, list) or not ranks:
            raise TransferError("malformed transfer metadata: empty tensor-parallel group")
        return [bytes(md) for md in ranks]
    return [metadata]


def _agent_info(metadata: bytes, keys: ClusterKeys | None) -> tuple[str, KVShard]:
    """(agent name, KV shard) an agent's metadata names."""
    return read_metadata(
        metadata, keys, lambda env: (str(env["name"]), KVShard.from_list(env["shard"]))
    )


@dataclass
class _Peer:
    generation: int
    metadata: bytes
    # per rank of ours: (peer rank agent name, model heads) to read
    reads: list[list[tuple[str, range]]]
    known: bool = True  # False: the ranks were told to forget it; re-added at the next read


@dataclass
class GroupHandle:
    """One `GroupAgent.read_pages`: rank 0's reads here, the other ranks' by request id."""

    peer: str
    deadline: float
    local: list[TransferHandle]
    remote: dict[int, int] = field(default_factory=dict)  # request id -> rank
    state: TransferState = "pending"
    error: str | None = None


class GroupAgent(EventLoopWaits):
    """The transfer agent of a worker's ranks (see the module notes)."""

    def __init__(self, local: KVTransferAgent, size: int = 1) -> None:
        """``local``: rank 0's agent. With ``size`` > 1, bind the socket the other ranks'
        agents connect to (`endpoint`); then start them (`serve_rank` in each rank
        process) and call `wait_ranks`."""
        self.local, self.size = local, size
        self.name, self.kv, self.compat = local.name, local.kv, local.compat
        self.keys = local.keys
        self._peers: dict[str, _Peer] = {}
        self._ranks_md: list[bytes] = [local.metadata()]
        self._ids = itertools.count(1)
        self._results: dict[int, tuple[str, str | None]] = {}
        self._dropped: set[int] = set()  # requests whose answers nobody waits for
        self._told: dict[int, str] = {}  # requests whose answers are only logged
        self._served_until = 0.0
        self._closed = False
        self._ctx: zmq.Context | None = None
        if size > 1:
            self._dir = tempfile.mkdtemp(prefix="radixserve-tp-")
            self.endpoint = f"ipc://{self._dir}/agents"
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.bind(self.endpoint)
            self._idents: dict[int, bytes] = {}

    # ---- ranks ----------------------------------------------------------------------

    def wait_ranks(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every other rank's agent has reported its metadata."""
        mds: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout_s
        while len(mds) < self.size - 1:
            if not self._sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise TransferError(f"tensor-parallel ranks {sorted(set(range(1, self.size)) - set(mds))} "
                                    f"did not start their transfer agents in {timeout_s:.0f} s")  # fmt: skip
            ident, raw = self._sock.recv_multipart()
            msg = msgpack.unpackb(raw, raw=False)
            if msg.get("op") == "hello":
                rank = int(msg["rank"])
                self._idents[rank], mds[rank] = ident, bytes(msg["metadata"])
        self._ranks_md += [mds[r] for r in range(1, self.size)]

    def _send(self, rank: int, msg: dict[str, Any]) -> None:
        self._sock.send_multipart([self._idents[rank], msgpack.packb(msg, use_bin_type=True)])

    def _drain(self, block_s: float = 0.0) -> None:
        """Record every answer the ranks have sent (waiting up to ``block_s`` for one)."""
        if self.size == 1:
            return
        timeout = int(block_s * 1000)
        while self._sock.poll(timeout):
            timeout = 0
            _, raw = self._sock.recv_multipart()
            msg = msgpack.unpackb(raw, raw=False)
            request = int(msg["id"])
            if request in self._dropped:
                self._dropped.discard(request)
            elif request in self._told:
                what = self._told.pop(request)
                if msg["state"] != "done":
                    logger.warning("tensor-parallel %s failed: %s", what, msg.get("error"))
            else:
                self._results[request] = (str(msg["state"]), msg.get("error"))

    def _tell(self, rank: int, msg: dict[str, Any]) -> None:
        """Send ``msg`` to ``rank`` without waiting (a rank runs its requests in order, so
        a read sent later finds the peer it adds); a failure is logged when it answers."""
        request = next(self._ids)
        self._told[request] = f"rank {rank}: {msg['op']} {msg.get('name', '')}"
        self._send(rank, {**msg, "id": request})

    def _ask_all(self, msg: dict[str, Any], timeout_s: float = 10.0) -> None:
        """Run ``msg`` on every rank but 0 and wait for each to answer (a call the peers'
        reads depend on); TransferError if one fails or does not answer in time."""
        asked = {}
        for rank in range(1, self.size):
            request = next(self._ids)
            asked[request] = rank
            self._send(rank, {**msg, "id": request})
        deadline = time.monotonic() + timeout_s
        while asked:
            left = deadline - time.monotonic()
            if left <= 0:
                self._dropped.update(asked)
                raise TransferError(f"tensor-parallel ranks {sorted(asked.values())} did not "
                                    f"answer {msg['op']} in {timeout_s:.0f} s")  # fmt: skip
            self._drain(min(left, 0.05))
            for request in [r for r in asked if r in self._results]:
                rank = asked.pop(request)
                state, error = self._results.pop(request)
                if state != "done":
                    raise TransferError(f"tensor-parallel rank {rank}: {msg['op']}: {error}")

    # ---- the agent interface ----------------------------------------------------------

    def metadata(self) -> bytes:
        """Every rank's agent metadata (a group of one: rank 0's agent's own)."""
        if self.size == 1:
            return self._ranks_md[0]
        return group_metadata(self._ranks_md, self.keys)

    @property
    def peers(self) -> dict[str, int]:
        return {name: peer.generation for name, peer in self._peers.items()}

    def add_peer(self, name: str, generation: int, metadata: bytes) -> None:
        """Know the worker ``name`` (a group, or one agent) at ``generation``: each of our
        ranks learns the peer ranks holding its heads. TransferError if the TP sizes
        cannot exchange pages, or any rank refuses the peer."""
        known = self._peers.get(name)
        if known is not None and known.generation == generation and known.known:
            return
        ranks_md = split_metadata(metadata, self.keys)
        infos = [_agent_info(md, self.keys) for md in ranks_md]
        error = tp_pair_error(self.size, len(ranks_md))
        if error:
            raise TransferError(f"peer {name!r}: {error}")
        if known is not None:
            self.remove_peer(name)
        self._peers[name] = _Peer(generation, metadata, self._learn(generation, ranks_md, infos))

    def _learn(
        self, generation: int, ranks_md: list[bytes], infos: list[tuple[str, KVShard]]
    ) -> list[list[tuple[str, range]]]:
        """Give each of our ranks the peer ranks holding its heads; what each reads."""
        name = infos[0][0]
        shards = [shard for _, shard in infos]
        reads: list[list[tuple[str, range]]] = []
        for rank, md in enumerate(self._ranks_md):
            _, mine = _agent_info(md, self.keys)
            try:
                sources = head_sources(mine, shards)
            except ValueError as exc:
                raise TransferError(f"peer {name!r}: {exc}") from None
            reads.append([(infos[i][0], heads) for i, heads in sources])
            for i, _ in sources:
                peer_name, peer_md = infos[i][0], ranks_md[i]
                if rank == 0:
                    self.local.add_peer(peer_name, generation, peer_md)
                else:
                    self._tell(rank, {"op": "add_peer", "name": peer_name,
                                      "generation": generation, "metadata": peer_md})  # fmt: skip
        return reads

    def remove_peer(self, name: str) -> None:
        """Forget ``name`` on every rank; its pending reads fail. Unknown names are ignored."""
        peer = self._peers.pop(name, None)
        if peer is not None:
            self._forget(peer)

    def _forget(self, peer: _Peer) -> None:
        """Have every rank forget ``peer``'s ranks (failing their pending reads)."""
        if not peer.known:
            return
        peer.known = False
        for rank, reads in enumerate(peer.reads):
            for agent_name in {agent_name for agent_name, _ in reads}:
                if rank == 0:
                    self.local.remove_peer(agent_name)
                else:
                    self._tell(rank, {"op": "remove_peer", "name": agent_name})

    def enforce_grants(self) -> None:
        """Every rank's agent serves only granted pages (`KVTransferAgent.enforce_grants`)."""
        self.local.enforce_grants()
        self._ask_all({"op": "enforce_grants"})

    def grant(self, peer: str, page_ids: list[int]) -> None:
        """Lend ``page_ids`` to the worker ``peer`` on every rank, before it returns."""
        self.local.grant(peer, page_ids)
        self._ask_all({"op": "grant", "name": peer, "pages": page_ids})

    def revoke(self, peer: str, page_ids: list[int] | None = None) -> None:
        """Take the grants back on every rank (`KVTransferAgent.revoke`)."""
        self.local.revoke(peer, page_ids)
        self._ask_all({"op": "revoke", "name": peer, "pages": page_ids})

    @property
    def refused_reads(self) -> int:
        """Reads rank 0's agent refused (each rank counts its own)."""
        return self.local.refused_reads

    def read_pages(
        self,
        peer: str,
        remote_page_ids: list[int],
        local_page_ids: list[int],
        timeout_s: float | None = None,
    ) -> GroupHandle:
        """Every rank reads its heads of the peer's ``remote_page_ids`` into its
        ``local_page_ids``. TransferError on an unknown peer or bad arguments."""
        known = self._peers.get(peer)
        if known is None:
            raise TransferError(f"unknown peer {peer!r}; call add_peer first")
        if not known.known:  # forgotten after a failed read: learn it again
            self.add_peer(peer, known.generation, known.metadata)
            known = self._peers[peer]
        timeout = self.local.default_timeout_s if timeout_s is None else timeout_s
        remote, local = list(remote_page_ids), list(local_page_ids)
        handle = GroupHandle(peer, time.monotonic() + timeout, [
            self.local.read_pages(agent_name, remote, local, timeout, heads)
            for agent_name, heads in known.reads[0]
        ])  # fmt: skip
        for rank in range(1, self.size):
            for agent_name, heads in known.reads[rank]:
                request = next(self._ids)
                handle.remote[request] = rank
                self._send(rank, {"op": "read", "id": request, "peer": agent_name,
                                  "remote": remote, "local": local, "timeout": timeout,
                                  "heads": [heads.start, heads.stop]})  # fmt: skip
        return handle

    def poll(self, handle: GroupHandle) -> TransferState:  # type: ignore[override]
        """ "pending", "done" or "failed" (why: ``handle.error``); never blocks."""
        if handle.state != "pending":
            return handle.state
        states = [self.local.poll(h) for h in handle.local]
        errors = [h.error for h in handle.local if h.state == "failed"]
        self._drain()
        for request, rank in list(handle.remote.items()):
            result = self._results.pop(request, None)
            if result is None:
                states.append("pending")
                continue
            del handle.remote[request]
            if result[0] != "done":
                errors.append(f"rank {rank}: {result[1]}")
        if errors:
            self._fail(handle, "; ".join(str(e) for e in errors))
        elif all(s == "done" for s in states):
            handle.state = "done"
        elif time.monotonic() > handle.deadline:
            self._fail(handle, f"transfer from {handle.peer!r} timed out")
        return handle.state

    def _fail(self, handle: GroupHandle, error: str) -> None:
        """End ``handle`` failed. Reads of it still running on some rank could land in
        pages the caller frees next: the ranks forget the peer, which fails them (the
        peer is learnt again at its next read)."""
        handle.state, handle.error = "failed", error
        if handle.remote or any(h.state == "pending" for h in handle.local):
            self._dropped.update(handle.remote)
            handle.remote.clear()
            peer = self._peers.get(handle.peer)
            if peer is not None:
                self._forget(peer)
        logger.warning("KV transfer from %r failed: %s", handle.peer, error)

    def serve_reads(self) -> None:
        """Drive every rank's side of peers' reads of our pages."""
        self.local.serve_reads()
        now = time.monotonic()
        if self.size > 1 and now > self._served_until - SERVE_S / 2:
            self._served_until = now + SERVE_S
            for rank in range(1, self.size):
                self._send(rank, {"op": "serve", "seconds": SERVE_S})

    def close(self) -> None:
        """Close every rank's agent and ours. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.size > 1:
            for rank in self._idents:
                with contextlib.suppress(zmq.ZMQError):
                    self._send(rank, {"op": "close"})
            assert self._ctx is not None
            self._sock.close(linger=0)
            self._ctx.destroy(linger=0)
            with contextlib.suppress(OSError):
                os.unlink(f"{self._dir}/agents")
                os.rmdir(self._dir)
        self.local.close()
