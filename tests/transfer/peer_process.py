"""A page-owning peer in a second process, plus the transfer suite both backends run.

`PeerProcess` spawns `run_peer` (multiprocessing "spawn"): it builds a small pool, fills
it with `fill_pattern(seed)`, creates a transfer agent and sends its metadata back over
a pipe, then serves reads of its pages until told to stop (or killed).
`TransferSuite` holds the backend-independent tests; each backend's test module
subclasses it with `backend = "..."`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.transfer import (
    KVTransferAgent,
    PoolCompat,
    TransferError,
    TransferNetwork,
    create_agent,
)

NUM_PAGES = 16
START_TIMEOUT_S = 60.0


def make_pool(head_dim: int = 8, num_pages: int = NUM_PAGES) -> tuple[KVPool, PoolCompat]:
    # 2 layers, 2 KV heads, pages of 4 tokens
    pool = KVPool(2, 2, head_dim, 4, num_pages, torch.float32, torch.device("cpu"))
    return pool, PoolCompat.of(pool.kv, "tiny")


def fill_pattern(kv: torch.Tensor, seed: int) -> None:
    """Distinct, exactly representable value per element, different per seed."""
    values = torch.arange(kv.numel(), dtype=torch.float64) + seed * 100_000
    kv.copy_(values.view_as(kv).to(kv.dtype))


def run_peer(
    conn: Connection,
    backend: str,
    name: str,
    seed: int,
    head_dim: int,
    network: TransferNetwork | None = None,
) -> None:
    """Child process body: own a filled pool and serve it until "stop"."""
    pool, compat = make_pool(head_dim)
    fill_pattern(pool.kv, seed)
    agent = create_agent(backend, name, pool.kv, compat, network=network)
    conn.send(agent.metadata())
    try:
        while True:
            if not conn.poll(0.0002):
                agent.serve_reads()  # the owner's side of reads (NIXL has no thread of its own)
                continue
            command = conn.recv()
            if command == "stop":
                break
    finally:
        agent.close()
        conn.close()


class PeerProcess:
    """A running `run_peer`; `metadata` is set once the child is ready."""

    def __init__(
        self,
        backend: str,
        name: str,
        seed: int,
        head_dim: int = 8,
        network: TransferNetwork | None = None,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=run_peer, args=(child, backend, name, seed, head_dim, network), daemon=True
        )
        self.process.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"peer {name!r} did not start")
        self.metadata: bytes = self._conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
        self._conn.close()


def _pages(kv: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return kv[:, :, ids]  # (L, 2, n, S, H, D): every layer, K and V


class TransferSuite:
    """Backend-independent tests; subclasses set `backend`."""

    backend: str = ""
    REMOTE = [5, 2, 3, 11, 0]  # 2, 3 -> 14, 15 is a run consecutive on both sides
    LOCAL = [9, 14, 15, 1, 6]

    @pytest.fixture
    def reader(self) -> Any:
        pool, compat = make_pool()
        pool.kv.fill_(-1.0)
        agent = create_agent(self.backend, "reader", pool.kv, compat, default_timeout_s=5.0)
        yield agent
        agent.close()

    @pytest.fixture
    def spawn(self) -> Any:
        started: list[PeerProcess] = []

        def _spawn(name: str, seed: int, head_dim: int = 8) -> PeerProcess:
            started.append(PeerProcess(self.backend, name, seed, head_dim))
            return started[-1]

        yield _spawn
        for peer in started:
            peer.stop()

    def test_scattered_pages_move_whole_and_nothing_else(
        self, reader: KVTransferAgent, spawn: Any
    ) -> None:
        peer = spawn("owner", seed=1)
        reader.add_peer("owner", 1, peer.metadata)
        reader.wait(reader.read_pages("owner", self.REMOTE, self.LOCAL))
        expected, _ = make_pool()
        fill_pattern(expected.kv, 1)
        assert torch.equal(_pages(reader.kv, self.LOCAL), _pages(expected.kv, self.REMOTE))
        others = [p for p in range(NUM_PAGES) if p not in self.LOCAL]
        assert bool((_pages(reader.kv, others) == -1.0).all())

    def test_incompatible_peer_is_refused(self, reader: KVTransferAgent, spawn: Any) -> None:
        peer = spawn("owner", seed=1, head_dim=16)
        with pytest.raises(TransferError, match="head_dim"):
            reader.add_peer("owner", 1, peer.metadata)
        assert reader.peers == {}
        with pytest.raises(TransferError, match="unknown peer"):
            reader.read_pages("owner", [0], [0])

    def test_dead_peer_fails_within_bounded_time(self, reader: KVTransferAgent, spawn: Any) -> None:
        peer = spawn("owner", seed=1)
        reader.add_peer("owner", 1, peer.metadata)
        reader.wait(reader.read_pages("owner", [1], [1]))
        peer.kill()
        start = time.monotonic()
        with pytest.raises(TransferError):
            reader.wait(reader.read_pages("owner", [2, 3], [2, 3], timeout_s=2.0))
        assert time.monotonic() - start < 4.0

    def test_new_generation_replaces_stale_peer(self, reader: KVTransferAgent, spawn: Any) -> None:
        old = spawn("owner", seed=1)
        reader.add_peer("owner", 1, old.metadata)
        reader.wait(reader.read_pages("owner", [4], [4]))
        old.kill()
        stale = reader.read_pages("owner", [7], [7], timeout_s=30.0)
        new = spawn("owner", seed=2)
        reader.add_peer("owner", 2, new.metadata)
        assert reader.poll(stale) == "failed" and reader.peers == {"owner": 2}
        reader.wait(reader.read_pages("owner", self.REMOTE, self.LOCAL))
        expected, _ = make_pool()
        fill_pattern(expected.kv, 2)
        assert torch.equal(_pages(reader.kv, self.LOCAL), _pages(expected.kv, self.REMOTE))
        with pytest.raises(TransferError, match="changed metadata"):
            reader.add_peer("owner", 2, old.metadata)
