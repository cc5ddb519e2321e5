"""Talking over links, written once: a request/reply correlator with a timeout, a send
that gives up quietly on a peer that is gone, and a set of fire-and-forget tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

from radixserve.protocol import Message
from radixserve.runtime.links import Link

logger = logging.getLogger(__name__)

R = TypeVar("R")


class Replies(Generic[R]):
    """Questions sent over links, each waiting for the reply that carries its key."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[R | None]] = {}

    async def ask(self, link: Link, msg: Message, key: str, timeout_s: float) -> R | None:
        """Send ``msg`` and wait up to ``timeout_s`` for `answer(key, ...)`; None if the
        message could not be sent, no answer came in time, or `drop_all` ended the wait."""
        reply: asyncio.Future[R | None] = asyncio.get_running_loop().create_future()
        self._waiting[key] = reply
        try:
            await link.send(msg, timeout_ms=0)
            return await asyncio.wait_for(reply, timeout_s)
        except TimeoutError:
            return None
        finally:
            self._waiting.pop(key, None)

    def answer(self, key: str, reply: R) -> bool:
        """Hand ``reply`` to whoever waits on ``key``; False if nobody does any more."""
        waiting = self._waiting.get(key)
        if waiting is None or waiting.done():
            return False
        waiting.set_result(reply)
        return True

    def drop_all(self) -> None:
        """The peer is gone: every wait ends now with None."""
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_result(None)


async def send_quietly(link: Link | None, msg: Message, timeout_ms: int = 0) -> bool:
    """Send ``msg`` if ``link`` is up; False (nothing raised) if the peer is gone: for
    notices whose loss the protocol survives (an abort, a release: leases expire)."""
    if link is None or not link.up:
        return False
    try:
        await link.send(msg, timeout_ms=timeout_ms)
    except TimeoutError:
        return False
    return True


class Tasks:
    """Fire-and-forget tasks a component owns: kept referenced until done, cancelled and
    awaited on `close`, their failures logged."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s: background task failed", self._owner, exc_info=task.exception())

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
