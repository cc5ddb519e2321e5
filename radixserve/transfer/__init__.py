"""Moving KV-cache pages between processes: one interface, NIXL and ZMQ backends.

`KVTransferAgent` (base) is the contract; `NixlTransferAgent` (NIXL/UCX, one-sided
reads of registered memory) and `ZmqTransferAgent` (TCP fallback) implement it;
`PoolCompat` describes what two pools must share; `TransferNetwork` where an agent
listens and what it advertises. `create_agent` picks by name.
"""

from __future__ import annotations

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.transfer.base import (
    KVTransferAgent,
    TransferError,
    TransferHandle,
    TransferState,
    peer_compat,
)
from radixserve.transfer.compat import PoolCompat
from radixserve.transfer.network import TransferNetwork

BACKENDS = ("nixl", "zmq")

__all__ = [
    "BACKENDS",
    "KVTransferAgent",
    "PoolCompat",
    "TransferError",
    "TransferHandle",
    "TransferNetwork",
    "TransferState",
    "create_agent",
    "peer_compat",
]


def create_agent(
    backend: str,
    name: str,
    pool: torch.Tensor | KVPool,
    compat: PoolCompat,
    default_timeout_s: float = 10.0,
    nixl_progress_thread: bool = False,
    network: TransferNetwork | None = None,
) -> KVTransferAgent:
    """An agent of `backend` ("nixl" or "zmq"); raises TransferError if unavailable.

    ``nixl_progress_thread`` gives a NIXL agent its own progress thread (busy-polling a
    core); without it, the page owner calls `serve_reads` while peers read. ``network``:
    where it listens and what it advertises (default: loopback, any port)."""
    if backend == "nixl":
        from radixserve.transfer.nixl import NixlTransferAgent

        return NixlTransferAgent(
            name, pool, compat, default_timeout_s, nixl_progress_thread, network
        )
    if backend == "zmq":
        from radixserve.transfer.zmq import ZmqTransferAgent

        return ZmqTransferAgent(name, pool, compat, default_timeout_s, network)
    raise TransferError(f"unknown KV transfer backend {backend!r}; choose from {BACKENDS}")
