"""A tensor-parallel rank's transfer agent, driven by rank 0's `GroupAgent` (`group`): in
each rank process but rank 0, a thread reports the agent's metadata, then runs rank 0's
requests on it (peers added and removed, grants, reads, serving peers' reads) and answers
each by its id."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from radixserve.transfer.base import KVTransferAgent, TransferError, TransferHandle

logger = logging.getLogger(__name__)


def serve_rank(agent: KVTransferAgent, endpoint: str, rank: int) -> threading.Thread:
    """In rank ``rank``'s process: report ``agent``'s metadata to rank 0's `GroupAgent` at
    ``endpoint`` and run its requests on a thread (the agent's only user) until it says
    close or the socket's peer is gone; the thread, started."""
    thread = threading.Thread(target=_serve_rank, args=(agent, endpoint, rank),
                              name=f"radixserve-tp{rank}-agent", daemon=True)  # fmt: skip
    thread.start()
    return thread


def _serve_rank(agent: KVTransferAgent, endpoint: str, rank: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)

    def send(msg: dict[str, Any]) -> None:
        sock.send(msgpack.packb(msg, use_bin_type=True))

    send({"op": "hello", "rank": rank, "metadata": agent.metadata()})
    reads: dict[int, TransferHandle] = {}
    serve_until = 0.0
    try:
        while True:
            busy = bool(reads) or time.monotonic() < serve_until
            if sock.poll(0 if busy else 50):
                msg = msgpack.unpackb(sock.recv(), raw=False)
                op = msg["op"]
                if op == "close":
                    return
                if op == "serve":
                    serve_until = time.monotonic() + float(msg["seconds"])
                else:
                    reads.update(_rank_call(agent, msg, send))
            if busy:
                agent.serve_reads()
                for request, handle in list(reads.items()):
                    try:
                        state = agent.poll(handle)
                    except Exception as exc:  # noqa: BLE001 - fail the read, keep serving
                        logger.exception("tensor-parallel rank %d: read %d failed", rank, request)
                        state, handle.state, handle.error = "failed", "failed", repr(exc)
                    if state != "pending":
                        del reads[request]
                        send({"id": request, "state": handle.state, "error": handle.error})
                if not sock.poll(0):
                    time.sleep(0.0002)
    except zmq.ZMQError as exc:
        logger.warning("tensor-parallel rank %d: transfer agent socket: %s", rank, exc)
    finally:
        agent.close()
        sock.close(linger=0)
        ctx.destroy(linger=0)


def _rank_call(
    agent: KVTransferAgent, msg: dict[str, Any], send: Callable[[dict[str, Any]], None]
) -> dict[int, TransferHandle]:
    """Run one request of rank 0 on ``agent``: a started read, or an answered call."""
    request, op = int(msg["id"]), msg["op"]
    try:
        if op == "read":
            lo, hi = msg["heads"]
            handle = agent.read_pages(msg["peer"], msg["remote"], msg["local"],
                                      float(msg["timeout"]), range(lo, hi))  # fmt: skip
            return {request: handle}
        if op == "add_peer":
            agent.add_peer(msg["name"], int(msg["generation"]), bytes(msg["metadata"]))
        elif op == "remove_peer":
            agent.remove_peer(msg["name"])
        elif op == "enforce_grants":
            agent.enforce_grants()
        elif op == "grant":
            agent.grant(msg["name"], [int(p) for p in msg["pages"]])
        elif op == "revoke":
            pages = msg["pages"]
            agent.revoke(msg["name"], None if pages is None else [int(p) for p in pages])
        else:
            raise TransferError(f"unknown request {op!r}")
    except Exception as exc:  # noqa: BLE001 - answered as a failure; the rank serves on
        if not isinstance(exc, TransferError):
            logger.exception("tensor-parallel agent request %r failed", op)
        send({"id": request, "state": "failed", "error": str(exc)})
    else:
        send({"id": request, "state": "done", "error": None})
    return {}
