"""The KV page transfer interface shared by every backend (NIXL, ZMQ).

An agent wraps one pool tensor (`radixserve.cache.kv_pool`'s tensor, layout (L, 2, P, S, H, D)). A peer learns
how to reach it from `metadata()` (opaque bytes, carried by whatever control plane the
caller has) and calls `add_peer(name, generation, metadata)`; after that it can *pull*
pages with `read_pages`. A page is always moved whole: for page p, the 2*L runs
`r * num_pages + p` (region r = layer * 2 + kind), i.e. every layer's K and V.

Contracts:
  * Compatibility is checked in `add_peer` (hash of `PoolCompat`); a mismatch raises
    `TransferError` and the peer is not added.
  * A peer is known by name. `add_peer` with a new generation replaces the old entry;
    transfers still pending against the old generation fail ("stale peer"), so a
    restarted peer's pages are never confused with its predecessor's.
  * A transfer is "done" only when every byte of every requested page has landed;
    errors, short replies and timeouts end in "failed" and `wait` raises.
  * Every transfer has a deadline: a dead peer yields `TransferError`, never a hang.
  * The page owner calls `serve_reads` often (every few hundred µs) while a peer may be
    reading its pages (`serve_reads_while` is that loop for an asyncio owner): a backend
    without a progress thread of its own (NIXL here: its thread would busy-poll a core
    forever) makes progress only inside agent calls. An asyncio reader waits with
    `wait_async`.
  * Agents are not thread-safe: use one from a single thread.
  * Grants: an owner that lends its pages may say whom to (`enforce_grants`, then
    `grant(peer, page_ids)` where it lends them and `revoke` where they come back); from
    then on a backend that serves reads itself (ZMQ) refuses a read of a page not granted
    to the asking peer, counted in `refused_reads`. A grant to ``decode-0`` covers its
    tensor-parallel ranks' agents (``decode-0.tp1`` ...). The asking peer's name is the
    one its request declares: the cluster secret proves a reader is a member, not which
    member, so a grant keeps a confused or stale member off pages lent to another, not a
    member that lies about its name. NIXL cannot enforce grants: its reads are one-sided
    (RDMA-style; the owner's CPU never sees them), so its agent keeps the ledger only.
  * Tensor parallelism: an agent holds one rank's pool, the KV heads of its `KVShard`
    (metadata carries it). `read_pages` reads the given model heads (default: all of
    ours, which the peer must hold), so a rank reads from each peer rank just the heads
    it needs (`radixserve.transfer.shards.head_sources`); each such read is one transfer.
"""

from __future__ import annotations

import itertools
import logging
import time
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack
import torch

from radixserve.errors import RadixServeError
from radixserve.protocol.security import AuthError, ClusterKeys
from radixserve.transfer.compat import PoolCompat
from radixserve.transfer.grants import PageGrants
from radixserve.transfer.network import TransferNetwork
from radixserve.transfer.shards import KVShard
from radixserve.transfer.waits import EventLoopWaits, TransferState

logger = logging.getLogger(__name__)

_METADATA_VERSION = 2  # 2: region_bytes (was page_bytes)
T = TypeVar("T")


class TransferError(RadixServeError):
    """A KV transfer cannot start or did not complete (incompatible/dead/stale peer...)."""


@dataclass
class TransferHandle:
    """One in-flight `read_pages` call; inspect it with `poll`/`wait` on its agent."""

    id: int
    peer: str
    generation: int
    num_pages: int
    deadline: float  # time.monotonic() after which the transfer counts as failed
    state: TransferState = "pending"
    error: str | None = None


@dataclass(frozen=True)
class HeadCut:
    """A read of some heads of each page: the peer's pool heads [remote, remote + count)
    into ours [local, local + count) (offsets within each pool's heads)."""

    remote: int
    local: int
    count: int


@dataclass(frozen=True)
class PeerInfo:
    """A peer as decoded from its `metadata()` plus the generation the caller gave."""

    name: str
    generation: int
    compat: PoolCompat
    shard: KVShard
    num_pages: int
    region_bytes: int  # one page of one layer's K (or V) on the peer's shard
    backend_md: dict[str, Any]
    raw: bytes = field(repr=False)


def read_metadata(metadata: bytes, keys: ClusterKeys | None, read: Callable[[Any], T]) -> T:
    """``read`` of an agent's (or a group's) decoded ``metadata``, its signature checked
    with ``keys`` first; TransferError if it is not signed with them or is malformed
    (``read`` raising ValueError, KeyError or TypeError included)."""
    try:
        raw = keys.open(metadata) if keys is not None else metadata
        return read(msgpack.unpackb(raw, raw=False))
    except AuthError as exc:
        raise TransferError(str(exc)) from None
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise TransferError(f"malformed transfer metadata: {exc}") from None


def peer_compat(metadata: bytes, keys: ClusterKeys | None = None) -> PoolCompat:
    """The pool layout an agent's `metadata` describes, checking its signature first with
    ``keys`` (for a side that has no agent yet); TransferError if it is malformed or
    not signed with them."""
    return read_metadata(metadata, keys, lambda env: PoolCompat.from_dict(env["compat"]))


class KVTransferAgent(EventLoopWaits):
    """Moves whole KV pages between this process's pool and peers' pools."""

    backend_name: ClassVar[str]

    def __init__(
        self,
        name: str,
        pool: torch.Tensor,
        compat: PoolCompat,
        default_timeout_s: float = 10.0,
        network: TransferNetwork | None = None,
        shard: KVShard | None = None,
    ) -> None:
        kv = self.kv = pool
        self.shard = shard or KVShard.whole(compat.num_kv_heads)
        compat.check_tensor(kv, self.shard)
        self.name = name
        self.compat = compat
        self.network = network or TransferNetwork()  # where it listens (loopback by default)
        self.keys = self.network.keys  # with a cluster secret: sign and check metadata
        self.num_pages = int(kv.shape[2])
        self.num_regions = int(kv.shape[0]) * 2
        self.region_bytes = int(kv[0, 0, 0].numel() * kv.element_size())  # compat.region_bytes
        self.default_timeout_s = default_timeout_s
        self._peers: dict[str, tuple[PeerInfo, Any]] = {}
        self._active: dict[int, TransferHandle] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self.grants = PageGrants()
        self.refused_reads = 0  # reads refused (malformed, out of pool, not granted ...)

    # ---- metadata and peers -------------------------------------------------------

    def metadata(self) -> bytes:
        """What a peer passes to `add_peer` to reach this agent (msgpack bytes)."""
        envelope = {
            "v": _METADATA_VERSION,
            "backend": self.backend_name,
            "name": self.name,
            "compat": self.compat.to_dict(),
            "compat_hash": self.compat.digest,
            "shard": self.shard.to_list(),
            "num_pages": self.num_pages,
            "region_bytes": self.region_bytes,
            "backend_md": self._backend_metadata(),
        }
        packed: bytes = msgpack.packb(envelope, use_bin_type=True)
        return self.keys.sign(packed) if self.keys is not None else packed

    def add_peer(self, name: str, generation: int, metadata: bytes) -> None:
        """Know peer `name` at `generation`; replace it if its generation changed.

        Raises TransferError on malformed metadata, another backend, or an incompatible
        pool, and, with cluster keys, on metadata not signed with them. Re-adding the same
        generation with identical metadata is a no-op.
        """
        self._check_open()
        if self.keys is not None:
            try:
                metadata = self.keys.open(metadata)
            except AuthError as exc:
                raise TransferError(f"peer {name!r}: {exc}") from None
        known = self._peers.get(name)
        if known is not None and known[0].generation == generation:
            if known[0].raw != metadata:
                raise TransferError(f"peer {name!r} generation {generation} changed metadata")
            return
        info = self._decode_peer(name, generation, metadata)
        if known is not None:
            logger.info("peer %r: generation %d replaces %d", name, generation, known[0].generation)
            self.remove_peer(name)
        self._peers[name] = (info, self._connect(info))

    def remove_peer(self, name: str) -> None:
        """Forget `name`; its pending transfers fail. Unknown names are ignored."""
        known = self._peers.pop(name, None)
        if known is None:
            return
        for handle in [h for h in self._active.values() if h.peer == name]:
            self._finish(handle, "failed", f"peer {name!r} was removed or replaced")
        self._disconnect(*known)

    @property
    def peers(self) -> dict[str, int]:
        """Known peers and their generations."""
        return {name: info.generation for name, (info, _) in self._peers.items()}

    def _decode_peer(self, name: str, generation: int, metadata: bytes) -> PeerInfo:
        try:
            env = msgpack.unpackb(metadata, raw=False)
            if not isinstance(env, dict):
                raise TypeError(f"a {type(env).__name__}, not a map")
            if env.get("v") != _METADATA_VERSION:
                raise TransferError(f"peer {name!r} sends transfer metadata version "
                                    f"{env.get('v')!r}, this side {_METADATA_VERSION}: "
                                    "run the same radixserve release on both")  # fmt: skip
            compat = PoolCompat.from_dict(env["compat"])
            backend, remote_name = env["backend"], env["name"]
            info = PeerInfo(
                name=name,
                generation=generation,
                compat=compat,
                shard=KVShard.from_list(env["shard"]),
                num_pages=int(env["num_pages"]),
                region_bytes=int(env["region_bytes"]),
                backend_md=dict(env["backend_md"]),
                raw=bytes(metadata),
            )
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            raise TransferError(f"peer {name!r}: malformed transfer metadata ({exc})") from exc
        if backend != self.backend_name:
            raise TransferError(
                f"peer {name!r} uses backend {backend!r}, not {self.backend_name!r}"
            )
        if remote_name != name:
            raise TransferError(f"metadata is for agent {remote_name!r}, not {name!r}")
        if env.get("compat_hash") != compat.digest or compat.digest != self.compat.digest:
            diff = "; ".join(self.compat.mismatches(compat)) or "compat hash differs"
            raise TransferError(f"peer {name!r} has an incompatible KV pool: {diff}")
        if info.region_bytes * self.shard.count != self.region_bytes * info.shard.count:
            raise TransferError(
                f"peer {name!r} page region is {info.region_bytes} bytes for "
                f"{info.shard.count} KV heads, ours {self.region_bytes} for {self.shard.count}"
            )
        return info

    # ---- grants -------------------------------------------------------------------

    def enforce_grants(self) -> None:
        """Serve only pages granted to the reader from now on (module notes)."""
        self.grants.enforced = True

    def grant(self, peer: str, page_ids: list[int]) -> None:
        """Lend ``page_ids`` to ``peer`` (once more each: a grant per lease)."""
        self.grants.grant(peer, page_ids)

    def revoke(self, peer: str, page_ids: list[int] | None = None) -> None:
        """Take back one grant of each of ``page_ids`` from ``peer`` (None: all of its)."""
        self.grants.revoke(peer, page_ids)

    # ---- transfers ----------------------------------------------------------------

    def read_pages(
        self,
        peer: str,
        remote_page_ids: list[int],
        local_page_ids: list[int],
        timeout_s: float | None = None,
        heads: range | None = None,
    ) -> TransferHandle:
        """Start pulling `remote_page_ids` of `peer` into `local_page_ids` (same order).

        Every layer's K and V of each page is copied: the model's KV heads ``heads``
        (default: all of ours), which both pools must hold. The transfer fails if not
        done within `timeout_s` (default `default_timeout_s`).
        Bad arguments or an unknown peer raise TransferError here; transport failures
        (even ones detected while posting) are reported by `poll`/`wait`.
        """
        self._check_open()
        if peer not in self._peers:
            raise TransferError(f"unknown peer {peer!r}; call add_peer first")
        info, state = self._peers[peer]
        remote, local = _validate_ids(
            remote_page_ids, local_page_ids, info.num_pages, self.num_pages
        )
        cut = self._cut(info, self.shard.heads if heads is None else heads)
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        handle = TransferHandle(
            id=next(self._ids),
            peer=peer,
            generation=info.generation,
            num_pages=len(local),
            deadline=time.monotonic() + timeout,
        )
        self._active[handle.id] = handle
        try:
            self._start_read(handle, info, state, remote, local, cut)
        except TransferError as exc:  # transport trouble: reported by poll/wait
            self._finish(handle, "failed", str(exc))
        return handle

    def _cut(self, info: PeerInfo, heads: range) -> HeadCut | None:
        """The head cut reading ``heads`` from ``info`` takes; None for whole pages."""
        for side, shard in (("ours", self.shard), (f"peer {info.name!r}'s", info.shard)):
            if not heads or heads.start < shard.first or heads.stop > shard.heads.stop:
                raise TransferError(f"KV heads {heads.start}..{heads.stop - 1} are not all "
                                    f"in {side} ({shard.first}..{shard.heads.stop - 1})")  # fmt: skip
        if len(heads) == self.shard.count == info.shard.count:
            return None
        return HeadCut(heads.start - info.shard.first, heads.start - self.shard.first, len(heads))

    def poll(self, handle: TransferHandle) -> TransferState:
        """Non-blocking: "pending", "done" or "failed" (reason in `handle.error`)."""
        if handle.state != "pending":
            return handle.state
        known = self._peers.get(handle.peer)
        if known is None or known[0].generation != handle.generation:
            self._finish(handle, "failed", f"peer {handle.peer!r} generation is stale")
            return handle.state
        state, error = self._progress(handle)
        if state == "pending" and time.monotonic() > handle.deadline:
            state, error = "failed", f"transfer from {handle.peer!r} timed out"
        if state != "pending":
            self._finish(handle, state, error)
        return handle.state

    def wait(self, handle: TransferHandle, timeout_s: float | None = None) -> None:
        """Block until `handle` is done; raise TransferError if it failed or timed out.

        A wait that times out cancels the transfer: its local pages hold unknown data.
        """
        limit = handle.deadline if timeout_s is None else time.monotonic() + timeout_s
        while self.poll(handle) == "pending":
            remaining = limit - time.monotonic()
            if remaining <= 0:
                self._finish(handle, "failed", f"wait for {handle.peer!r} timed out")
                break
            self._idle(min(remaining, 0.05))
        if handle.state == "failed":
            raise TransferError(handle.error or "transfer failed")

    def serve_reads(self) -> None:
        """Drive our side of peers' reads of our pages (cheap; see the module notes)."""
        self._check_open()
        self._serve_reads()

    def close(self) -> None:
        """Fail pending transfers, drop every peer, deregister memory. Idempotent."""
        if self._closed:
            return
        for name in list(self._peers):
            self.remove_peer(name)
        for handle in list(self._active.values()):
            self._finish(handle, "failed", "agent closed")
        self._closed = True
        self._shutdown()

    def _finish(self, handle: TransferHandle, state: TransferState, error: str | None) -> None:
        handle.state, handle.error = state, error
        if self._active.pop(handle.id, None) is not None:
            self._release(handle)
        if state == "failed":
            logger.warning("KV transfer %d from %r failed: %s", handle.id, handle.peer, error)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transfer agent {self.name!r} is closed")

    def _serve_reads(self) -> None:
        """Backend hook of `serve_reads`; backends that serve from a thread need none."""
        return None

    def _idle(self, seconds: float) -> None:
        """Wait a little for progress; backends with a pollable socket override this."""
        time.sleep(min(seconds, 0.0002))

    # ---- backend hooks ------------------------------------------------------------

    @abstractmethod
    def _backend_metadata(self) -> dict[str, Any]:
        """Backend part of `metadata()` (msgpack-encodable)."""

    @abstractmethod
    def _connect(self, info: PeerInfo) -> Any:
        """Prepare to read from a validated peer; return per-peer backend state."""

    @abstractmethod
    def _disconnect(self, info: PeerInfo, state: Any) -> None:
        """Release what `_connect` created."""

    @abstractmethod
    def _start_read(
        self,
        handle: TransferHandle,
        info: PeerInfo,
        state: Any,
        remote: list[int],
        local: list[int],
        cut: HeadCut | None,
    ) -> None:
        """Post the read (of the heads ``cut``, or whole pages); raise TransferError if it
        cannot be posted."""

    @abstractmethod
    def _progress(self, handle: TransferHandle) -> tuple[TransferState, str | None]:
        """Advance/check `handle`; return its state and, if failed, why."""

    @abstractmethod
    def _release(self, handle: TransferHandle) -> None:
        """Free backend resources of a finished handle (cancel it if still in flight)."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Close sockets / deregister memory."""


def _validate_ids(
    remote: list[int], local: list[int], remote_pages: int, local_pages: int
) -> tuple[list[int], list[int]]:
    remote, local = [int(p) for p in remote], [int(p) for p in local]
    if not local or len(remote) != len(local):
        raise TransferError(f"need equal, non-empty page lists (got {len(remote)}, {len(local)})")
    if len(set(local)) != len(local):
        raise TransferError("local page ids must be distinct")
    if min(remote) < 0 or max(remote) >= remote_pages:
        raise TransferError(f"remote page id out of range [0, {remote_pages})")
    if min(local) < 0 or max(local) >= local_pages:
        raise TransferError(f"local page id out of range [0, {local_pages})")
    return remote, local


def region_page_indices(page_ids: list[int], num_regions: int, num_pages: int) -> list[int]:
    """Descriptor ids `r * num_pages + p`, region-major, for every region and page."""
    return [r * num_pages + p for r in range(num_regions) for p in page_ids]
