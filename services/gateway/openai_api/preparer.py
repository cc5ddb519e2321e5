"""The gateway's preparation pool: the CPU work that turns a request into engine jobs
(chat templates, tokenization, grammar compilation) runs here, off the event loop, so
one large request never stalls the other streams or ``/live``.

Contracts:

* at most ``num_workers`` steps run at once (a `ThreadPoolExecutor`); each request gets
  ``timeout_s`` for all of its steps together (`Preparer.begin` starts the clock);
* a step still running at its request's deadline answers 400 naming the field it was
  preparing (``response_format``, ``tools``, ``messages``...). A thread cannot be
  killed: the step finishes in the background and its result is dropped, but it keeps
  its worker until then, so the pool stays bounded (the size caps of `limits`, checked
  before any step is queued, keep such steps short);
* a step still queued at the deadline (every worker busy) never runs: 429, retry.

The heavy libraries release the GIL while they work (llguidance's compiler, and the
tokenizer's batch entry point `Tokenizer.encode` uses), so a step in a worker leaves
the loop free; a chat template renders in Python and shares the GIL in 5 ms slices.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from radixserve.services.gateway.server.errors import OpenAIError, retry_after

T = TypeVar("T")


class Preparer:
    """The bounded pool of preparation workers (one per gateway)."""

    def __init__(self, num_workers: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="gateway-prepare")
        self._pending: set[Future[Any]] = set()  # submitted, not finished (queued or running)

    @property
    def num_pending(self) -> int:
        """Steps queued or running, a timed-out one included until it ends."""
        return sum(not work.done() for work in list(self._pending))

    def begin(self) -> Preparation:
        """One request's preparation: its steps share ``timeout_s`` from now."""
        return Preparation(self, time.monotonic() + self.timeout_s)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        work = self._executor.submit(fn, *args)
        self._pending.add(work)
        work.add_done_callback(self._pending.discard)
        return work

    def close(self, wait: bool = False) -> None:
        """Drop queued steps; running ones finish in their threads (awaited if `wait`)."""
        self._executor.shutdown(wait=wait, cancel_futures=True)


class Preparation:
    """The steps of one request, run in the pool against one deadline."""

    def __init__(self, pool: Preparer, deadline: float) -> None:
        self._pool = pool
        self._deadline = deadline

    async def run(self, field: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker; its exceptions propagate. `field` is the request
        field the step prepares, named by the 400 when the deadline passes first."""
        work = self._pool.submit(fn, *args)
        remaining = max(0.0, self._deadline - time.monotonic())
        try:
            return await asyncio.wait_for(asyncio.wrap_future(work), remaining)
        except TimeoutError:
            if work.cancel():  # still queued: it will never run
                raise OpenAIError(
                    429, "server busy: every request-preparation worker is taken; retry "
                    "shortly", headers=retry_after(),
                ) from None  # fmt: skip
            raise OpenAIError(
                400, f"{field}: preparing it (chat template, tokenization or grammar "
                f"compilation) took longer than the gateway's prepare_timeout_s "
                f"({self._pool.timeout_s:g} s): make it smaller or simpler", field,
            ) from None  # fmt: skip
