"""Async streaming on top of `Engine`: the engine steps on its own thread.

Callers on an asyncio loop submit requests through a thread-safe inbox; each step's
outputs are handed back to the caller's loop with `call_soon_threadsafe`. Leaving the
`stream()` iterator early (a client disconnect) aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from radixserve.engine.engine import Engine
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import RequestError

logger = logging.getLogger(__name__)


@dataclass
class _Submit:
    prompt: str | Sequence[int]
    params: SamplingParams
    request_id: str
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    """Thread-safe front of an Engine. `close()` stops the thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[_Submit | _Abort | None] = queue.Queue()
        self._streams: dict[str, _Submit] = {}
        self._ids = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="radixserve-engine", daemon=True)
        self._thread.start()

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput per step until the request finishes. Raises RequestError
        (e.g. InvalidRequestError) before the first output for input it can't serve.
        `request_id` must be unique among live requests; one is made up if not given."""
        if request_id is None:
            with self._lock:
                self._ids += 1
                request_id = f"async-{self._ids}"
        out: asyncio.Queue = asyncio.Queue()
        self._inbox.put(
            _Submit(prompt, params or SamplingParams(), request_id, asyncio.get_running_loop(), out)
        )
        finished = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id))

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def _drain_inbox(self, block: bool) -> bool:
        """Handle every queued submit/abort (waiting for one if `block`); False on close."""
        while True:
            try:
                msg = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if msg is None:
                self._abort_all()
                return False
            self._handle(msg)

    def _loop(self) -> None:
        while self._drain_inbox(block=not self.engine.has_unfinished()):
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in a step: fail every live stream, keep serving
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            for output in outputs:
                self._deliver(output.request_id, output, output.finished)

    def _handle(self, msg: _Submit | _Abort) -> None:
        if isinstance(msg, _Abort):
            self._streams.pop(msg.request_id, None)
            self.engine.abort(msg.request_id)
            return
        try:
            self.engine.add_request(msg.prompt, msg.params, msg.request_id)
        except RequestError as exc:
            msg.loop.call_soon_threadsafe(msg.out.put_nowait, exc)
            return
        self._streams[msg.request_id] = msg

    def _deliver(self, request_id: str, item: object, last: bool) -> None:
        sub = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if sub is not None:
            sub.loop.call_soon_threadsafe(sub.out.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            self._deliver(request_id, exc, last=True)

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            output = self.engine.abort(request_id)
            if output is not None:
                self._deliver(request_id, output, last=True)
