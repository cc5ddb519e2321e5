"""KV page transfer over ZMQ: the fallback when NIXL/UCX is unavailable.

Owner side: a ROUTER socket (background thread), bound where the agent's
`TransferNetwork` says and advertised under its address, answers read requests with one
multipart message: a msgpack header, then one frame per (region, run) — region-major —
where a run is a stretch of pages consecutive on *both* sides. Frames are sent straight
from pool memory (`copy=False`); a CUDA pool is staged through host memory.

Bounds: the owner's socket takes no message over `MAX_REQUEST_BYTES` (ZMQ_MAXMSGSIZE:
the peer is disconnected), decodes a request within msgpack limits, and refuses (and
counts, `refused_reads`) a read of more than `MAX_READ_RUNS` runs, of pages outside
its pool, or, once the owner enforces grants, of a page not granted to the reader the
request names in ``from`` (self-declared: see `radixserve.transfer.base`, Grants); a
reader's socket takes no frame larger than its own pool's region.

Reader side: one DEALER socket per peer. A request is a msgpack map
``{"op": "read", "id", "from", "compat", "runs": [[remote_start, count], ...], "heads"}``
(no pickle); ``heads`` is ``[first, count]`` of the owner's pool heads for a read of some
heads of each slot (a tensor-parallel rank's), staged into one contiguous frame per run,
or nil for whole pages. Reply frames are received directly into the destination pool pages
(`recv_into`) after checking every frame's size; any mismatch, error reply or a
deadline passing fails the transfer.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from radixserve.transfer.base import (
    HeadCut,
    KVTransferAgent,
    PeerInfo,
    TransferError,
    TransferHandle,
)
from radixserve.transfer.compat import PoolCompat
from radixserve.transfer.network import TransferNetwork, url_host
from radixserve.transfer.shards import KVShard
from radixserve.transfer.waits import TransferState

logger = logging.getLogger(__name__)

Run = tuple[int, int, int]  # (remote_start, local_start, count)

#: page runs one read request may ask for: a read of one request's pages needs a few
#: hundred at most; a read needing more fails at the reader (it is never sent)
MAX_READ_RUNS = 1 << 16
_RUN_BYTES = 11  # one [start, count] pair in msgpack at most: array header, two uint32
#: the largest read request (ZMQ_MAXMSGSIZE of the owner's socket): the runs, plus the
#: id, names and compat digest
MAX_REQUEST_BYTES = 4096 + MAX_READ_RUNS * _RUN_BYTES
#: msgpack limits of a request or reply header: short strings, and room for a request a
#: little over `MAX_READ_RUNS` runs to be decoded and refused by name (with a reply)
_HEADER_LIMITS: dict[str, int] = {"max_array_len": 2 * MAX_READ_RUNS, "max_map_len": 16,
                                  "max_str_len": 4096, "max_bin_len": 0, "max_ext_len": 0}  # fmt: skip


def page_runs(remote: list[int], local: list[int]) -> list[Run]:
    """Split paired page lists into runs consecutive in both remote and local ids."""
    runs: list[Run] = []
    for r, loc in zip(remote, local):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == loc:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((r, loc, 1))
    return runs


def _bind(sock: zmq.Socket, net: TransferNetwork) -> int:
    """Bind ``sock`` to ``net.bind_host`` on the first free port of its range (any free
    one without a range); the port. `TransferError` if none is free."""
    address = f"tcp://{url_host(net.bind_host)}"
    ports = range(net.port_min, net.port_max + 1) if net.port_min else [0]
    error: zmq.ZMQError | None = None
    for port in ports:
        try:
            sock.bind(f"{address}:{port}")
        except zmq.ZMQError as exc:
            error = exc
            if exc.errno != zmq.EADDRINUSE:
                break
            continue
        return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    raise TransferError(f"cannot bind the ZMQ KV agent to {net.bind_host} "
                        f"(ports {net.port_range or 'any'}): {error}")  # fmt: skip


@dataclass
class _Request:
    handle: TransferHandle
    runs: list[Run]
    cut: HeadCut | None = None


@dataclass
class _Peer:
    socket: zmq.Socket
    requests: dict[int, _Request] = field(default_factory=dict)


class ZmqTransferAgent(KVTransferAgent):
    """`KVTransferAgent` serving and reading pages over ZMQ TCP sockets."""

    backend_name = "zmq"

    def __init__(
        self,
        name: str,
        pool: torch.Tensor,
        compat: PoolCompat,
        default_timeout_s: float = 10.0,
        network: TransferNetwork | None = None,
        shard: KVShard | None = None,
    ) -> None:
        super().__init__(name, pool, compat, default_timeout_s, network, shard)
        self._pages = (
            self.kv.view(-1)
            .view(torch.uint8)
            .view(self.num_regions, self.num_pages, self.region_bytes)
        )
        self._host_pages = None if self.kv.is_cuda else self._pages.numpy()
        self._ctx = zmq.Context()
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        self._server.setsockopt(zmq.SNDHWM, 0)
        self._server.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # larger: peer dropped
        if self.keys is not None:
            self.keys.secure(self._server, bind=True)
        try:
            port = _bind(self._server, self.network)
        except TransferError:
            self._ctx.destroy(linger=0)
            raise
        self._endpoint = f"tcp://{url_host(self.network.advertised)}:{port}"
        self._results: dict[int, tuple[TransferState, str | None]] = {}
        self._request_ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kv-zmq-{name}", daemon=True)
        self._thread.start()
        logger.info("ZMQ KV agent %r serving on %s", name, self._endpoint)

    # ---- owner side ---------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._server.poll(50):
                    continue
                ident, raw = self._server.recv_multipart()[:2]
                self._handle_request(ident, raw)
            except zmq.ZMQError as exc:
                if not self._stop.is_set():
                    logger.error("ZMQ KV server %r: %s", self.name, exc)
                return
            except Exception:  # keep serving other readers
                logger.exception("ZMQ KV server %r failed on a request", self.name)

    def _handle_request(self, ident: bytes, raw: bytes) -> None:
        try:
            req = msgpack.unpackb(raw, raw=False, **_HEADER_LIMITS)
            op = req["op"]
        except (ValueError, KeyError, TypeError, msgpack.UnpackException):
            self.refused_reads += 1
            logger.warning("ZMQ KV server %r: malformed request dropped", self.name)
            return
        reply: dict[str, Any] = {"id": req.get("id"), "ok": False, "error": None}
        if op != "read":
            reply["error"] = f"unknown op {op!r}"
        elif req.get("compat") != self.compat.digest:
            reply["error"] = f"incompatible KV pool (compat hash of {self.name!r} differs)"
        else:
            try:
                if len(req["runs"]) > MAX_READ_RUNS:
                    raise ValueError(f"{len(req['runs'])} page runs, at most {MAX_READ_RUNS}")
                runs = [(int(s), int(n)) for s, n in req["runs"]]
                self._check_granted(str(req.get("from")), runs)
                heads = req.get("heads")
                frames = (self._serve_runs(runs) if heads is None
                          else self._serve_cut(runs, int(heads[0]), int(heads[1])))  # fmt: skip
            except (ValueError, KeyError, TypeError) as exc:
                reply["error"] = f"bad read request: {exc}"
            else:
                reply["ok"] = True
                self._server.send_multipart([ident, msgpack.packb(reply), *frames], copy=False)
                return
        self.refused_reads += 1
        logger.warning("ZMQ KV server %r refused a read: %s", self.name, reply["error"])
        self._server.send_multipart([ident, msgpack.packb(reply)])

    def _check_granted(self, reader: str, runs: list[tuple[int, int]]) -> None:
        """`ValueError` unless every page of ``runs`` is granted to ``reader`` (when this
        agent enforces grants: `KVTransferAgent.enforce_grants`)."""
        if not self.grants.enforced:
            return
        if sum(max(0, count) for _, count in runs) > self.num_pages:
            raise ValueError(f"pages not lent to {reader!r}")  # more than the pool holds
        pages = [p for start, count in runs for p in range(start, start + max(0, count))]
        if not self.grants.allows(reader, pages):
            raise ValueError(f"pages not lent to {reader!r}")

    def _serve_runs(self, runs: list[tuple[int, int]]) -> list[Any]:
        """One buffer per (region, run), region-major, viewing (or staging) pool bytes."""
        for start, count in runs:
            if count < 1 or start < 0 or start + count > self.num_pages:
                raise ValueError(f"page run [{start}, {start + count}) out of range")
        frames: list[Any] = []
        for region in range(self.num_regions):
            for start, count in runs:
                if self._host_pages is not None:
                    frames.append(self._host_pages[region, start : start + count].data)
                else:
                    frames.append(self._pages[region, start : start + count].cpu().numpy())
        return frames

    def _slots(self) -> torch.Tensor:
        """The pool's bytes as (region, page, slot, head, head bytes)."""
        return self._pages.view(self.num_regions, self.num_pages, self.compat.page_size,
                                self.shard.count, -1)  # fmt: skip

    def _serve_cut(self, runs: list[tuple[int, int]], first: int, count: int) -> list[Any]:
        """One staged buffer per (region, run): heads [first, first + count) of each slot."""
        if count < 1 or first < 0 or first + count > self.shard.count:
            raise ValueError(f"heads [{first}, {first + count}) out of range")
        for start, n in runs:
            if n < 1 or start < 0 or start + n > self.num_pages:
                raise ValueError(f"page run [{start}, {start + n}) out of range")
        slots = self._slots()
        return [
            slots[region, start : start + n, :, first : first + count].contiguous().cpu().numpy()
            for region in range(self.num_regions)
            for start, n in runs
        ]

    def _backend_metadata(self) -> dict[str, Any]:
        return {"endpoint": self._endpoint}

    # ---- reader side --------------------------------------------------------------

    def _connect(self, info: PeerInfo) -> _Peer:
        endpoint = info.backend_md.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            raise TransferError(f"peer {info.name!r} metadata has no tcp endpoint")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        # a reply frame is one run of pages (or their heads) landing in our pool
        sock.setsockopt(zmq.MAXMSGSIZE, max(MAX_REQUEST_BYTES, self.num_pages * self.region_bytes))
        if self.keys is not None:
            self.keys.secure(sock, bind=False)
        sock.connect(endpoint)
        return _Peer(sock)

    def _disconnect(self, info: PeerInfo, state: Any) -> None:
        state.socket.close(linger=0)

    def _start_read(
        self,
        handle: TransferHandle,
        info: PeerInfo,
        state: Any,
        remote: list[int],
        local: list[int],
        cut: HeadCut | None,
    ) -> None:
        runs = page_runs(remote, local)
        if len(runs) > MAX_READ_RUNS:
            raise TransferError(f"the read needs {len(runs)} page runs; a peer serves at most "
                                f"{MAX_READ_RUNS} per read: split it")  # fmt: skip
        request_id = next(self._request_ids)
        header = {
            "op": "read",
            "id": request_id,
            "from": self.name,
            "compat": self.compat.digest,
            "runs": [[r, n] for r, _, n in runs],
            "heads": None if cut is None else [cut.remote, cut.count],
        }
        try:
            state.socket.send(msgpack.packb(header), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise TransferError(f"cannot send read request to {info.name!r}: {exc}") from exc
        state.requests[request_id] = _Request(handle, runs, cut)

    def _progress(self, handle: TransferHandle) -> tuple[TransferState, str | None]:
        known = self._peers.get(handle.peer)
        if known is not None:
            self._drain_replies(known[1])
        return self._results.pop(handle.id, ("pending", None))

    def _drain_replies(self, peer: _Peer) -> None:
        """Apply every reply already queued on `peer`'s socket (never blocks)."""
        while peer.socket.poll(0):
            header = msgpack.unpackb(peer.socket.recv(), raw=False, **_HEADER_LIMITS)
            request = peer.requests.pop(header.get("id"), None)
            if request is None:  # reply to a cancelled/timed-out read: discard it
                while peer.socket.getsockopt(zmq.RCVMORE):
                    peer.socket.recv_into(bytearray())
                continue
            self._results[request.handle.id] = self._receive_pages(peer, header, request)

    def _receive_pages(
        self, peer: _Peer, header: dict[str, Any], request: _Request
    ) -> tuple[TransferState, str | None]:
        """Receive the reply's frames into local pages; fail on any size/count mismatch."""
        error = None if header.get("ok") else str(header.get("error") or "peer refused read")
        expected = [(region, run) for region in range(self.num_regions) for run in request.runs]
        received = 0
        while peer.socket.getsockopt(zmq.RCVMORE):
            if error is not None or received >= len(expected):
                peer.socket.recv_into(bytearray())
                error = error or "peer sent more frames than requested"
                continue
            region, (_, local_start, count) = expected[received]
            if request.cut is None:
                error = self._receive_frame(peer.socket, region, local_start, count)
            else:
                error = self._receive_cut(peer.socket, region, local_start, count, request.cut)
            received += 1
        if error is None and received != len(expected):
            error = f"peer sent {received} of {len(expected)} page runs"
        return ("failed", error) if error is not None else ("done", None)

    def _receive_frame(self, sock: zmq.Socket, region: int, start: int, count: int) -> str | None:
        want = count * self.region_bytes
        if self._host_pages is not None:
            dst = self._host_pages[region, start : start + count].reshape(-1)
            got = sock.recv_into(dst.data)
        else:
            frame = sock.recv(copy=False)
            got = len(frame.buffer)
            if got == want:
                src = torch.from_numpy(np.frombuffer(frame.buffer, dtype=np.uint8).copy())
                with torch.inference_mode():  # the pool may be an inference tensor
                    self._pages[region, start : start + count].copy_(src.view(count, -1))
        return None if got == want else f"page run frame of {got} bytes, expected {want}"

    def _receive_cut(
        self, sock: zmq.Socket, region: int, start: int, count: int, cut: HeadCut
    ) -> str | None:
        dst = self._slots()[region, start : start + count, :, cut.local : cut.local + cut.count]
        staged = np.empty(dst.numel(), dtype=np.uint8)
        want, got = staged.size, sock.recv_into(staged.data)  # got: the frame's whole size
        if got == want:
            with torch.inference_mode():  # the pool may be an inference tensor
                dst.copy_(torch.from_numpy(staged).view(dst.shape))
        return None if got == want else f"page run frame of {got} bytes, expected {want}"

    def _release(self, handle: TransferHandle) -> None:
        self._results.pop(handle.id, None)
        known = self._peers.get(handle.peer)
        if known is not None:
            requests = known[1].requests
            for rid in [rid for rid, req in requests.items() if req.handle is handle]:
                del requests[rid]

    def _idle(self, seconds: float) -> None:
        poller = zmq.Poller()
        for _, peer in self._peers.values():
            poller.register(peer.socket, zmq.POLLIN)
        poller.poll(max(1, int(seconds * 1000)))

    def _shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._server.close(linger=0)
        self._ctx.destroy(linger=0)
