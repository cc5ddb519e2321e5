"""KV page transfer over NIXL (UCX backend): one-sided RDMA-style reads of pool pages.

The pattern vLLM's NixlConnector uses:
  * the pool tensor is registered with NIXL once, as a single region;
  * a descriptor list of every (region, page) run — descriptor id `r * num_pages + p`,
    `region_bytes` long — is prepared once locally and once per peer (`prep_xfer_dlist`);
  * a read is one `make_prepped_xfer("READ", ...)` over descriptor indices, posted with
    `transfer` and polled with `check_xfer_state`.

Memory kind follows the tensor: "DRAM" for CPU pools, "VRAM" for CUDA pools.

Network: the UCX variables of `TransferNetwork.ucx_env` (see `radixserve.transfer.network`),
set while the agent is created (UCX reads them then).

Progress: NIXL's own progress thread busy-polls a CPU core even when idle, so by default
the agent runs without it (``progress_thread=False``). The reader progresses its read
in `poll`; the owner must call `serve_reads` while a peer reads (UCX over TCP or
shared memory needs the target's progress; RDMA would not).

Grants (`KVTransferAgent.grant`): not enforced. A NIXL read is one-sided: the reader
posts it against the owner's registered memory and the owner's CPU takes no part, so
there is no point at which the owner could refuse a page. The agent keeps the ledger
(its owner's calls are the same as over ZMQ); protecting lent pages over NIXL rests on
the network (the cluster's transfer interfaces reachable by members only).

Failed reads: a read towards a peer that died can leave a UCX request queued on its
endpoint after NIXL reported the failure and its handle was released; destroying the
agent with it still queued aborts the process (UCX asserts `ucs_arbiter_group_is_empty`;
about 1 in 10 runs of the stale-peer test did). So once a read has failed, closing first
progresses UCX for `SETTLE_S`, which lets it fail and return that request.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from radixserve.transfer.base import (
    HeadCut,
    KVTransferAgent,
    PeerInfo,
    TransferError,
    TransferHandle,
    region_page_indices,
)
from radixserve.transfer.compat import PoolCompat
from radixserve.transfer.network import TransferNetwork
from radixserve.transfer.shards import KVShard
from radixserve.transfer.waits import TransferState

logger = logging.getLogger(__name__)

SETTLE_S = 0.25  # UCX progress before the agent goes, once a read has failed


def _import_nixl() -> tuple[Any, Any, tuple[type[Exception], ...]]:
    """(nixl_agent, nixl_agent_config, the exception types NIXL calls raise)."""
    try:
        from nixl import _bindings  # type: ignore[import-not-found]
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise TransferError(f"NIXL is not available: {exc}") from exc
    nixl_errors = tuple(
        obj
        for obj in vars(_bindings).values()
        if isinstance(obj, type) and issubclass(obj, Exception)
    )
    return (
        nixl_agent,
        nixl_agent_config,
        (RuntimeError, ValueError, TypeError, KeyError, *nixl_errors),
    )


def _as_str(name: str | bytes) -> str:
    """NIXL returns agent names as bytes in some calls and str in others."""
    return name.decode() if isinstance(name, bytes) else name


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set the variables of ``values`` the process does not have, for the block only."""
    added = [key for key in values if key not in os.environ]
    for key in added:
        os.environ[key] = values[key]
    for key in values.keys() - set(added):
        if os.environ[key] != values[key]:
            logger.info("NIXL: %s=%s from the environment (not %s)", key, os.environ[key],
                        values[key])  # fmt: skip
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _descriptor_table(base: int, num_descs: int, region_bytes: int, dev_id: int) -> np.ndarray:
    """Nx3 uint64 (address, length, device) for descriptors 0..num_descs-1."""
    table = np.empty((num_descs, 3), dtype=np.uint64)
    table[:, 0] = base + np.arange(num_descs, dtype=np.uint64) * np.uint64(region_bytes)
    table[:, 1] = region_bytes
    table[:, 2] = dev_id
    return table


class NixlTransferAgent(KVTransferAgent):
    """`KVTransferAgent` over a NIXL agent with the UCX backend."""

    backend_name = "nixl"

    def __init__(
        self,
        name: str,
        pool: torch.Tensor,
        compat: PoolCompat,
        default_timeout_s: float = 10.0,
        progress_thread: bool = False,
        network: TransferNetwork | None = None,
        shard: KVShard | None = None,
    ) -> None:
        super().__init__(name, pool, compat, default_timeout_s, network, shard)
        nixl_agent, nixl_agent_config, errors = _import_nixl()
        self._errors: tuple[type[Exception], ...] = errors
        self._mem_type = "VRAM" if self.kv.is_cuda else "DRAM"
        self._dev_id = (self.kv.device.index or 0) if self.kv.is_cuda else 0
        try:
            ucx_env = self.network.ucx_env()
        except ValueError as exc:
            raise TransferError(f"NIXL agent {name!r}: {exc}") from None
        try:
            with _environment(ucx_env):
                self._agent = nixl_agent(
                    name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
                )
        except self._errors as exc:
            raise TransferError(f"cannot create NIXL agent {name!r}: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise TransferError("NIXL has no UCX backend plugin on this machine")
        self._reg = self._agent.register_memory(self.kv)
        self._xfers: dict[int, Any] = {}
        self._had_failures = False  # a read failed: settle UCX before closing
        try:
            table = _descriptor_table(
                self.kv.data_ptr(),
                self.num_regions * self.num_pages,
                self.region_bytes,
                self._dev_id,
            )
            self._local_dlist = self._agent.prep_xfer_dlist("", table, self._mem_type)
        except self._errors as exc:
            self._agent.deregister_memory(self._reg)
            raise TransferError(f"cannot prepare local NIXL descriptors: {exc}") from exc
        logger.info("NIXL agent %r registered %d bytes of %s", name, self.kv.nbytes, self._mem_type)

    def _backend_metadata(self) -> dict[str, Any]:
        return {
            "agent_md": self._agent.get_agent_metadata(),
            "base_addr": self.kv.data_ptr(),
            "dev_id": self._dev_id,
            "mem_type": self._mem_type,
        }

    def _connect(self, info: PeerInfo) -> Any:
        md = info.backend_md
        try:
            remote_name = _as_str(self._agent.add_remote_agent(bytes(md["agent_md"])))
        except self._errors as exc:
            raise TransferError(f"NIXL rejected metadata of {info.name!r}: {exc}") from exc
        if remote_name != info.name:
            self._agent.remove_remote_agent(remote_name)
            raise TransferError(f"NIXL metadata names {remote_name!r}, expected {info.name!r}")
        try:
            table = _descriptor_table(
                int(md["base_addr"]),
                self.num_regions * info.num_pages,
                info.region_bytes,
                int(md["dev_id"]),
            )
            return self._agent.prep_xfer_dlist(remote_name, table, str(md["mem_type"]))
        except self._errors as exc:
            self._agent.remove_remote_agent(remote_name)
            raise TransferError(f"cannot prepare descriptors of {info.name!r}: {exc}") from exc

    def _disconnect(self, info: PeerInfo, state: Any) -> None:
        try:
            self._agent.release_dlist_handle(state)
            self._agent.remove_remote_agent(info.name)
        except self._errors as exc:
            logger.warning("NIXL cleanup of peer %r failed: %s", info.name, exc)

    def _start_read(
        self,
        handle: TransferHandle,
        info: PeerInfo,
        state: Any,
        remote: list[int],
        local: list[int],
        cut: HeadCut | None,
    ) -> None:
        try:
            if cut is None:  # whole pages: the prepared descriptors
                local_idx = np.asarray(
                    region_page_indices(local, self.num_regions, self.num_pages), dtype=np.int32
                )
                remote_idx = np.asarray(
                    region_page_indices(remote, self.num_regions, info.num_pages),
                    dtype=np.int32,
                )
                xfer = self._agent.make_prepped_xfer(
                    "READ", self._local_dlist, local_idx, state, remote_idx
                )
            else:  # some heads of each slot: descriptors made for this read
                xfer = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(self._cut_table(local, cut), self._mem_type),
                    self._agent.get_xfer_descs(
                        self._cut_table(remote, cut, info), str(info.backend_md["mem_type"])
                    ),
                    info.name,
                )
        except self._errors as exc:
            raise TransferError(f"cannot create NIXL read from {info.name!r}: {exc}") from exc
        self._xfers[handle.id] = xfer
        try:
            status = self._agent.transfer(xfer)
        except self._errors as exc:
            raise TransferError(f"cannot post NIXL read from {info.name!r}: {exc}") from exc
        if status == "ERR":
            raise TransferError(f"NIXL refused the read from {info.name!r}")

    def _cut_table(
        self, pages: list[int], cut: HeadCut, peer: PeerInfo | None = None
    ) -> np.ndarray:
        """Descriptors of ``cut``'s heads in each slot of ``pages``, every region (in
        region, page, slot order), in our pool or in ``peer``'s."""
        if peer is None:
            base, dev, num_pages, heads = (
                self.kv.data_ptr(),
                self._dev_id,
                self.num_pages,
                self.shard.count,
            )
            first = cut.local
        else:
            md = peer.backend_md
            base, dev, num_pages, heads = (
                int(md["base_addr"]),
                int(md["dev_id"]),
                peer.num_pages,
                peer.shard.count,
            )
            first = cut.remote
        slots, row = self.compat.page_size, self.compat.head_dim * self.kv.element_size()
        region = np.arange(self.num_regions, dtype=np.uint64)[:, None, None]
        page = np.asarray(pages, dtype=np.uint64)[None, :, None]
        slot = np.arange(slots, dtype=np.uint64)[None, None, :]
        addr = ((region * np.uint64(num_pages) + page) * np.uint64(slots) + slot) * np.uint64(
            heads * row
        )
        table = np.empty((addr.size, 3), dtype=np.uint64)
        table[:, 0] = np.uint64(base + first * row) + addr.reshape(-1)
        table[:, 1] = cut.count * row
        table[:, 2] = dev
        return table

    def _progress(self, handle: TransferHandle) -> tuple[TransferState, str | None]:
        try:
            status = self._agent.check_xfer_state(self._xfers[handle.id])
        except self._errors as exc:
            return "failed", f"NIXL read failed: {exc}"
        if status == "DONE":
            return "done", None
        if status == "PROC":
            return "pending", None
        return "failed", "NIXL reported a transfer error"

    def _release(self, handle: TransferHandle) -> None:
        if handle.state == "failed":
            self._had_failures = True
        xfer = self._xfers.pop(handle.id, None)
        if xfer is None:
            return
        try:
            self._agent.release_xfer_handle(xfer)
        except self._errors as exc:  # an in-flight read that cannot be cancelled
            logger.warning("NIXL could not release transfer %d: %s", handle.id, exc)

    def _serve_reads(self) -> None:
        # Collecting notifications (reads here send none) is the cheapest NIXL call that
        # progresses the UCX worker.
        self._agent.get_new_notifs()

    def _shutdown(self) -> None:
        if self._had_failures:  # see the module's docstring: failed reads
            end = time.monotonic() + SETTLE_S
            while time.monotonic() < end:
                with contextlib.suppress(*self._errors):
                    self._agent.get_new_notifs()  # progresses the UCX worker
                time.sleep(0.002)
        try:
            self._agent.release_dlist_handle(self._local_dlist)
            self._agent.deregister_memory(self._reg)
        except self._errors as exc:
            logger.warning("NIXL deregistration of %r failed: %s", self.name, exc)
