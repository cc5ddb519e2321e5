"""A transfer's state, and waiting on it (and serving peers' reads) from an asyncio loop."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal

TransferState = Literal["pending", "done", "failed"]


class EventLoopWaits(ABC):
    """An agent's asyncio loops, over its own `poll`, `remove_peer` and `serve_reads` (a
    `KVTransferAgent`'s, or a tensor-parallel worker's `GroupAgent`'s)."""

    @abstractmethod
    def poll(self, handle: Any) -> TransferState:
        """Non-blocking: "pending", "done" or "failed"."""

    @abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget peer ``name``; its pending transfers fail."""

    @abstractmethod
    def serve_reads(self) -> None:
        """Drive our side of peers' reads of our pages."""

    async def wait_async(self, handle: Any, period_s: float = 0.0005) -> TransferState:
        """Poll ``handle`` from an event loop until it is done or failed; its final state.

        If the caller is cancelled meanwhile, the peer is removed first, which fails the
        read, so that it can never land in pages the caller frees next."""
        try:
            while self.poll(handle) == "pending":
                await asyncio.sleep(period_s)
        except asyncio.CancelledError:
            self.remove_peer(handle.peer)
            raise
        return handle.state  # type: ignore[no-any-return]

    async def serve_reads_while(
        self,
        busy: Callable[[], bool],
        wake: asyncio.Event,
        after: Callable[[], None] | None = None,
        period_s: float = 0.0002,
    ) -> None:
        """Forever: call `serve_reads` every ``period_s`` while ``busy()`` (peers may be
        reading our pages), then ``after()``; otherwise sleep until ``wake`` is set (set it
        whenever ``busy()`` may have become true). Run it as the page owner's task."""
        while True:
            if not busy():
                wake.clear()
                await wake.wait()
                continue
            self.serve_reads()
            await asyncio.sleep(period_s)
            if after is not None:
                after()
