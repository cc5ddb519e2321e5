"""Async streaming on top of `Engine`: the engine steps on its own thread.

Callers on an asyncio loop hand the engine thread work through a thread-safe inbox:
`call(fn)` runs ``fn(engine)`` between two steps and returns its result (or raises its
exception) on the caller's loop; `call(fn, watch=request_id)` also routes every later
output of that request to a queue. `stream` is the plain case built on it. Outputs go
back to the caller's loop with `call_soon_threadsafe`. Leaving the `stream()` iterator
early (a client disconnect) aborts the request in the engine.

This is the engine's boundary: services use the named operations below (`admit`,
`activate_remote`, `finish_host_admission`, `release_lease`, `abort`, the cache
listeners), `info` (what the engine serves, fixed) and `stats` (counters taken on the
engine thread after every step and call), never the engine's own objects.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from radixserve.engine.admission import Admission, HostPlan
from radixserve.engine.engine import Engine
from radixserve.engine.fair_share import DEFAULT_SHARE, TenantShare
from radixserve.engine.info import EngineInfo, EngineStats
from radixserve.engine.outputs import RequestOutput, TokenLogprob
from radixserve.engine.sampling_params import SamplingParams
from radixserve.protocol.cached_tokens import CachedTokens
from radixserve.settings import EngineSettings

if TYPE_CHECKING:  # the listeners' signatures
    from radixserve.cache.radix_cache import BlockCallback, SpillCallback

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: What a watched request's queue receives: outputs, then a finished one or an exception.
OutputQueue = asyncio.Queue  # [RequestOutput | BaseException]


#: Sends a request's output itself, on the engine thread (a token endpoint); False hands it
#: to the request's queue instead, and every later output of the request with it.
Sink = Callable[[RequestOutput], bool]


@dataclass
class _Watch:
    loop: asyncio.AbstractEventLoop
    out: OutputQueue
    sink: Sink | None = None

    def put(self, item: object, last: bool) -> None:
        """Hand ``item`` on: to the sink while it takes them (never the last), else to the
        queue (``call_soon_threadsafe``: in order after the sink's sends)."""
        if self.sink is not None and not last and isinstance(item, RequestOutput):
            try:
                if self.sink(item):
                    return
            except Exception:  # noqa: BLE001 - the queue's way still works
                logger.exception("sending %s's output failed; it goes by the queue",
                                 item.request_id)  # fmt: skip
            self.sink = None
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    loop: asyncio.AbstractEventLoop | None  # None: fire and forget
    result: asyncio.Future | None
    watch: str | None  # request id whose outputs go to `out`
    out: OutputQueue | None
    sink: Sink | None = None  # sends the watched request's outputs but its last


class AsyncEngine:
    """Thread-safe front of an Engine. `close()` stops the thread."""

    def __init__(self, engine: Engine | Callable[[], Engine] | EngineSettings) -> None:
        """``engine``: the engine, its settings or a function that builds it, on the
        engine thread (returns once it is built, raises what building raised). Build it there on a
        CPU: OpenMP keeps a thread team per thread that starts parallel work, and once a
        process holds more of these threads than there are cores libgomp stops them
        spinning between parallel regions, so an engine loaded on one thread and stepped
        on another computes on several threads no faster than on one."""
        self._inbox: queue.Queue[_Call | None] = queue.Queue()
        self._watches: dict[str, _Watch] = {}
        self._ids = itertools.count(1)  # next() is atomic: callers on any thread
        self.engine: Engine
        failed: list[BaseException] = []
        ready = threading.Event()
        if isinstance(engine, Engine):
            self.engine = engine
            ready.set()
        build = (lambda: Engine(engine)) if isinstance(engine, EngineSettings) else engine

        def run() -> None:
            if not ready.is_set():
                try:
                    self.engine = build()  # type: ignore[operator]
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
        self.info = EngineInfo.of(self.engine)
        self._stats = EngineStats.of(self.engine)

    def stats(self) -> EngineStats:
        """The engine's counters after its latest step or call (safe from any thread)."""
        return self._stats

    # -- the operations services use ---------------------------------------------------

    async def admit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        remote_over: int | None = None,
        host: HostPlan | None = None,
        lease_s: float | None = None,
        resume: Sequence[int] = (),
        cache_scope: str = "",
        share: TenantShare = DEFAULT_SHARE,
        adapter: str = "",
        sink: Sink | None = None,
    ) -> tuple[Admission, OutputQueue]:
        """`Engine.admit` between two steps; the admission and the queue of the request's
        outputs from now on (with ``sink``, only those it does not send: its last one, and
        all from the first it refuses)."""
        admission, out = await self.call(
            lambda e: e.admit(prompt_ids, params, request_id, remote_over=remote_over,
                              host=host, lease_s=lease_s, resume=resume,
                              cache_scope=cache_scope, share=share, adapter=adapter),
            watch=request_id, sink=sink,
        )  # fmt: skip
        assert out is not None
        return admission, out

    def finish_host_admission(
        self, request_id: str, ok: bool, disk_pages: int = 0, peer: bool = False
    ) -> None:
        """The host-tier or peer read of an admitted request ended
        (`Engine.finish_host_admission`)."""
        self.submit(lambda e: e.finish_host_admission(request_id, ok, disk_pages, peer))

    def activate_remote(
        self,
        request_id: str,
        first_tokens: Sequence[int],
        cached: CachedTokens,
        first_logprobs: Sequence[TokenLogprob] = (),
        prompt_logprobs: Sequence[TokenLogprob] | None = None,
    ) -> None:
        """The reserved pages hold the prompt's KV now (`Engine.activate_remote`); the
        first outputs go to the request's watch."""
        self.submit(
            lambda e: e.activate_remote(request_id, list(first_tokens), cached, first_logprobs,
                                        prompt_logprobs),
            watch=request_id,
        )  # fmt: skip

    def release_lease(self, request_id: str) -> None:
        """The reader is done with a prefill's pages (or gave up): release its lease."""
        self.submit(lambda e: e.release_lease(request_id))

    async def abort_now(self, request_id: str) -> None:
        """`abort`, returning once the engine has released what the request held."""
        await self.call(lambda e: self._abort(e, request_id))

    def listen_cache(self, on_event: Callable[[str, list[int]], None] | None) -> None:
        """Report the radix cache's "stored"/"removed" page hashes to ``on_event`` (on the
        engine thread; None stops)."""
        self.submit(lambda e: e.cache.set_event_listener(on_event) if e.cache else None)

    def listen_blocks(self, on_block: BlockCallback | None) -> None:
        """Report the radix cache's stored pages (with their tokens and parent hash) and
        removed pages to ``on_block`` (on the engine thread; None stops)."""
        self.submit(lambda e: e.cache.set_block_listener(on_block) if e.cache else None)

    def resync_cache(self, emit: Callable[[str, list[int]], None]) -> None:
        """``emit("cleared", [])`` then ``emit("stored", every cached page hash)``, on the
        engine thread, in order with the events (a snapshot never overtakes one)."""

        def snapshot(e: Engine) -> None:
            emit("cleared", [])
            emit("stored", e.cache.all_page_hashes() if e.cache else [])

        self.submit(snapshot)

    def listen_spills(
        self,
        on_spill: SpillCallback | None,
        write_through_uses: int = 0,
        buffer: torch.Tensor | None = None,
        buffer_path: str | None = None,
    ) -> None:
        """Hand pages the cache evicts (and, with ``write_through_uses``, prefixes used
        that often) to ``on_spill(hashes, page_ids, proofs)`` on the engine thread; None
        stops.
        Starting forgets what was handed over before (the tier it went to is new).
        ``buffer`` (whole pages; a file at ``buffer_path`` with tensor parallelism, so
        every rank maps it) is where `copy_out` copies them."""

        self.submit(lambda e: e.spill.listen(on_spill, write_through_uses, buffer, buffer_path))

    def copy_out(self, page_ids: list[int], slots: list[int]) -> None:
        """Copy pages into ``slots`` of the spill buffer (`listen_spills`), on every rank.
        Only on the engine thread: from ``on_spill``, before the cache lets them go."""
        self.engine.spill.copy_out(page_ids, slots)

    async def call(
        self, fn: Callable[[Engine], T], watch: str | None = None, sink: Sink | None = None
    ) -> tuple[T, OutputQueue | None]:
        """Run ``fn(engine)`` on the engine thread; return its result and, with ``watch``,
        the queue that receives request ``watch``'s outputs from now on (the last one has
        ``finished`` set, or an exception if a step failed); if ``fn`` itself returns an
        output of that request, the queue gets it first. If ``fn`` raises, the exception
        is raised here and nothing is watched. ``sink``: sends the watched outputs on the
        engine thread while it takes them (`Sink`); the queue gets the rest."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()
        out: OutputQueue | None = asyncio.Queue() if watch is not None else None
        self._inbox.put(_Call(fn, loop, result, watch, out, sink))
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
        cache_scope: str = "",
        share: TenantShare = DEFAULT_SHARE,
        adapter: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput per step until the request finishes. Raises RequestError
        (e.g. InvalidRequestError) before the first output for input it can't serve.
        `request_id` must be unique among live requests; one is made up if not given.
        The request shares cached KV only within its ``cache_scope``, runs with LoRA
        ``adapter`` ("" for the base model), and is scheduled among other tenants' by its
        ``share`` (`Engine.add_request`)."""
        rid = f"async-{next(self._ids)}" if request_id is None else request_id
        _, out = await self.call(
            lambda e: e.add_request(prompt, params, rid, cache_scope, share, adapter), watch=rid
        )
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
        if not self._thread.is_alive():
            self.engine.close()

    # -- the engine thread -----------------------------------------------------------

    def _drain_inbox(self, block: bool) -> bool:
        """Handle every queued call (waiting for one if `block`, at most until the next
        page lease expires, which the next step releases); False on close."""
        while True:
            timeout = None
            deadline = self.engine.kv.leases.next_deadline() if block else None
            if deadline is not None:
                timeout = max(0.0, deadline - time.perf_counter()) + 0.001
            try:
                msg = self._inbox.get(block=block, timeout=timeout)
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
            self._stats = EngineStats.of(self.engine)
            for output in outputs:
                self._deliver(output.request_id, output, output.finished)

    def _handle(self, call: _Call) -> None:
        try:
            value = call.fn(self.engine)
        except Exception as exc:
            self._stats = EngineStats.of(self.engine)
            if call.loop is None:
                logger.exception("engine call failed")
                if call.watch is not None:
                    self._deliver(call.watch, exc, last=True)
            else:
                call.loop.call_soon_threadsafe(_settle, call.result, None, exc)
            return
        self._stats = EngineStats.of(self.engine)  # what the call changed, before its answer
        produced = value if isinstance(value, list) else [value]
        outputs = [v for v in produced if isinstance(v, RequestOutput)]
        if call.loop is None:  # submitted: outputs go where a step's would
            for output in outputs:
                self._deliver(output.request_id, output, output.finished)
            return
        if call.watch is not None and call.out is not None:
            watch = _Watch(call.loop, call.out, call.sink)
            mine = [output for output in outputs if output.request_id == call.watch]
            # fn produced the request's first outputs itself (e.g. activate_remote)
            for output in mine:
                watch.put(output, output.finished)
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
            watch.put(item, last)
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
