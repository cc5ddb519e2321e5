"""Moving KV-cache pages between processes: one interface, NIXL and ZMQ backends.

`KVTransferAgent` (base) is the contract; `NixlTransferAgent` (NIXL/UCX, one-sided
reads of registered memory) and `ZmqTransferAgent` (TCP fallback) implement it;
`PoolCompat` describes what two pools must share; `TransferNetwork` where an agent
listens and what it advertises. `create_agent` picks by name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    import torch

    from radixserve.transfer.base import (
        KVTransferAgent,
        TransferError,
        TransferHandle,
        peer_compat,
    )
    from radixserve.transfer.compat import PoolCompat
    from radixserve.transfer.network import TransferNetwork
    from radixserve.transfer.shards import KVShard
    from radixserve.transfer.waits import TransferState

#: the transfer backends, by name: the one list settings, flags and tools take them from
Backend = Literal["nixl", "zmq"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

# Loaded on first use (PEP 562): `transfer.network` (addresses, ports) is read by processes
# that never move a page — the gateway among them — and must not pull in torch.
_LAZY = {
    "KVTransferAgent": "base", "TransferError": "base", "TransferHandle": "base",
    "TransferState": "waits", "peer_compat": "base", "PoolCompat": "compat", "KVShard": "shards",
    "TransferNetwork": "network",
}  # fmt: skip

__all__ = [
    "BACKENDS",
    "Backend",
    "KVShard",
    "KVTransferAgent",
    "PoolCompat",
    "TransferError",
    "TransferHandle",
    "TransferNetwork",
    "TransferState",
    "create_agent",
    "peer_compat",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def create_agent(
    backend: str,
    name: str,
    pool: torch.Tensor,
    compat: PoolCompat,
    default_timeout_s: float = 10.0,
    nixl_progress_thread: bool = False,
    network: TransferNetwork | None = None,
    shard: KVShard | None = None,
) -> KVTransferAgent:
    """An agent of `backend` ("nixl" or "zmq"); raises TransferError if unavailable.

    ``nixl_progress_thread`` gives a NIXL agent its own progress thread (busy-polling a
    core); without it, the page owner calls `serve_reads` while peers read. ``network``:
    where it listens and what it advertises (default: loopback, any port); ``shard``: the
    KV heads ``pool`` holds (default: every head)."""
    if backend == "nixl":
        from radixserve.transfer.nixl import NixlTransferAgent

        return NixlTransferAgent(
            name, pool, compat, default_timeout_s, nixl_progress_thread, network, shard
        )
    if backend == "zmq":
        from radixserve.transfer.zmq import ZmqTransferAgent

        return ZmqTransferAgent(name, pool, compat, default_timeout_s, network, shard)
    from radixserve.transfer.base import TransferError

    raise TransferError(f"unknown KV transfer backend {backend!r}; choose from {BACKENDS}")
