"""Async streaming on top of `Engine`: the engine steps on its own thread.

Callers on an asyncio loop hand the engine thread work through a thread-safe inbox:
`call(fn)` runs ``fn(engine)`` between two steps and returns its result (or raises its
exception) on the caller's loop; `call(fn, watch=request_id)` also routes every later
output of that request to a queue. `stream` is the plain case built on it. Outputs go
back to the caller's loop with `call_soon_threadsafe`. Leaving the `stream()` iterator
early (a client disconnect) aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from radixserve.engine.engine import Engine
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: What a watched request's queue receives: outputs, then a finished one or an exception.
OutputQueue = asyncio.Queue  # [RequestOutput | BaseException]


@dataclass
class _Watch:
    loop: asyncio.AbstractEventLoop
    out: OutputQueue


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    loop: asyncio.AbstractEventLoop | None  # None: fire and forget
    result: asyncio.Future | None
    watch: str | None  # request id whose outputs go to `out`
    out: OutputQueue | None


class AsyncEngine:
    """Thread-safe front of an Engine. `close()` stops the thread."""

    def __init__(self, engine: Engine | Callable[[], Engine]) -> None:
        """``engine``: the engine, or a function that builds it on the engine thread
        (returns once it is built, raises what building raised). Build it there on a
        CPU: OpenMP keeps a thread team per thread that starts parallel work, and once a
        process holds more of these threads than there are cores libgomp stops them
        spinning between parallel regions, so an engine loaded on one thread and stepped
        on another computes on several threads no faster than on one."""
        self._inbox: queue.Queue[_Call | None] = queue.Queue()
        self._watches: dict[str, _Watch] = {}
        self._ids = 0
        self._lock = threading.Lock()
        self.engine: Engine
        failed: list[BaseException] = []
        ready = threading.Event()
        if isinstance(engine, Engine):
            self.engine = engine
            ready.set()

        def run() -> None:
            if not ready.is_set():
                try:
                    self.engine = engine()  # type: ignore[operator]
                except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
                    failed.append(exc)
                    return
                finally:
                    ready.set()
            self._loop()

        self._thread = threading.Thread(target=run, name="radixserve-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            raise failed[0]

    async def call(
        self, fn: Callable[[Engine], T], watch: str | None = None
    ) -> tuple[T, OutputQueue | None]:
        """Run ``fn(engine)`` on the engine thread; return its result and, with ``watch``,
        the queue that receives request ``watch``'s outputs from now on (the last one has
        ``finished`` set, or an exception if a step failed); if ``fn`` itself returns an
        output of that request, the queue gets it first. If ``fn`` raises, the exception
        is raised here and nothing is watched."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()
        out: OutputQueue | None = asyncio.Queue() if watch is not None else None
        self._inbox.put(_Call(fn, loop, result, watch, out))
        try:
            return await result, out
        except asyncio.CancelledError:  # the caller left: do not leave the request running
            if watch is not None:
                self.abort(watch)
            raise

    def submit(self, fn: Callable[[Engine], Any], watch: str | None = None) -> None:
        """Run ``fn(engine)`` on the engine thread without waiting. Outputs it returns go
        to their requests' watches (as a step's would); an error is logged and, with
        ``watch``, ends that request's watch (so its reader does not wait forever)."""
        self._inbox.put(_Call(fn, None, None, watch, None))

    def abort(self, request_id: str) -> None:
        """Abort a request and stop watching it (fire and forget)."""
        self.submit(lambda engine: self._abort(engine, request_id))

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
        rid = request_id
        _, out = await self.call(lambda e: e.add_request(prompt, params, rid), watch=rid)
        assert out is not None
        async for item in self.outputs(rid, out):
            yield item

    async def outputs(self, request_id: str, out: OutputQueue) -> AsyncIterator[RequestOutput]:
        """The outputs queued on ``out`` until a finished one; leaving early aborts."""
        finished = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    # -- the engine thread -----------------------------------------------------------

    def _drain_inbox(self, block: bool) -> bool:
        """Handle every queued call (waiting for one if `block`); False on close."""
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
        while True:
            idle = not self.engine.has_unfinished()
            if idle:
                self.engine.idle()
            if not self._drain_inbox(block=idle):
                break
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in a step: fail every live stream, keep serving
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            for output in outputs:
                self._deliver(output.request_id, output, output.finished)

    def _handle(self, call: _Call) -> None:
        try:
            value = call.fn(self.engine)
        except Exception as exc:
            if call.loop is None:
                logger.exception("engine call failed")
                if call.watch is not None:
                    self._deliver(call.watch, exc, last=True)
            else:
                call.loop.call_soon_threadsafe(_settle, call.result, None, exc)
            return
        if call.loop is None:  # submitted: outputs go where a step's would
            for output in value if isinstance(value, list) else [value]:
                if isinstance(output, RequestOutput):
                    self._deliver(output.request_id, output, output.finished)
            return
        if call.watch is not None and call.out is not None:
            watch = _Watch(call.loop, call.out)
            produced = value if isinstance(value, list) else [value]
            mine = [
                v for v in produced if isinstance(v, RequestOutput) and v.request_id == call.watch
            ]
            # fn produced the request's first outputs itself (e.g. activate_remote)
            for output in mine:
                call.loop.call_soon_threadsafe(call.out.put_nowait, output)
            if not any(output.finished for output in mine):
                self._watches[call.watch] = watch
        call.loop.call_soon_threadsafe(_settle, call.result, value, None)

    def _abort(self, engine: Engine, request_id: str) -> None:
        self._watches.pop(request_id, None)
        engine.abort(request_id)

    def _deliver(self, request_id: str, item: object, last: bool) -> None:
        watch = self._watches.pop(request_id, None) if last else self._watches.get(request_id)
        if watch is None:
            return
        try:
            watch.loop.call_soon_threadsafe(watch.out.put_nowait, item)
        except RuntimeError:  # its loop has closed: nobody reads it any more
            self._watches.pop(request_id, None)
            self.engine.abort(request_id)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._watches):
            self.engine.abort(request_id)
            self._deliver(request_id, exc, last=True)

    def _abort_all(self) -> None:
        for request_id in list(self._watches):
            output = self.engine.abort(request_id)
            if output is not None:
                self._deliver(request_id, output, last=True)


def _settle(future: asyncio.Future | None, value: object, exc: BaseException | None) -> None:
    if future is None or future.done():  # the caller gave up (cancelled) meanwhile
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)
