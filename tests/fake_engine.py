"""A fake engine, and the harness that runs the services over it in one test process.

`FakeEngine` stands in for the engine behind the `AsyncEngine` interface (the operations
the services call, `info` and `stats`), so that tests can check the services' own
branches — local or remote prefill, retries, refusals, aborts, leases, migration —
without a model: it is scripted and records every call. Its KV pool is a small real
CPU tensor, so real transfer agents move real bytes between a fake prefill engine and
a fake decode engine.

The rest is the harness: `run_scenario` runs a test's coroutine with a ZMQ context
for its own sockets; `serving` runs a `Service` (its real ROUTER socket on
127.0.0.1) on the test's event loop until the block ends; `PeerSocket` is a DEALER a
test speaks the protocol on (as a gateway to a decode worker, as a decode worker to a
prefill worker); `FakePeer` is a ROUTER standing in for a worker whose answers a test
scripts; `until` polls a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar

import torch
import zmq
import zmq.asyncio

from radixserve.cache.block_hash import hash_namespace
from radixserve.engine.admission import Admission, HostPlan, choose_route
from radixserve.engine.async_engine import AsyncEngine, Sink
from radixserve.engine.fair_share import DEFAULT_SHARE, TenantShare
from radixserve.engine.info import EngineInfo, EngineStats
from radixserve.engine.outputs import RequestOutput, TokenLogprob
from radixserve.engine.sampling_params import SamplingParams
from radixserve.protocol import (
    AsyncChannel,
    Heartbeat,
    Hello,
    HelloAck,
    Message,
    RequestFailed,
    TokenChunk,
    WorkerLoad,
)
from radixserve.protocol.cached_tokens import CachedTokens
from radixserve.protocol.security import ClusterKeys
from radixserve.protocol.stats_messages import ServiceStats
from radixserve.runtime.service import Service
from radixserve.transfer import KVShard, PoolCompat

MODEL = "fake-model"
NAMESPACE = hash_namespace(MODEL)
PAGE_SIZE = 4

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class EngineCall:
    """One operation a service asked of the engine."""

    op: str
    request_id: str
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class _Request:
    prompt_len: int
    max_tokens: int
    out: asyncio.Queue  # RequestOutput | BaseException
    pages: list[int] = field(default_factory=list)  # reserved (remote) or computed
    task: asyncio.Task | None = None
    sink: Sink | None = None  # sends its outputs but the last while it takes them

    def put(self, output: RequestOutput) -> None:
        """As `AsyncEngine` hands an output on: to the sink (on this loop here) while it
        takes them, never the last; else, and from then on, to the queue."""
        if self.sink is not None and not output.finished:
            if self.sink(output):
                return
            self.sink = None
        self.out.put_nowait(output)


class FakeEngine:
    """Stands in for `AsyncEngine` (the engine thread and its model) so that these tests
    check the services' branches without a model. Scripted:

    * ``admit`` routes by the engine's own rule (`choose_route`, nothing cached): remote
      when ``remote_over`` is set and the prompt is longer, with one reserved page per
      ``page_size`` prompt tokens (last one partial); a prefill (``lease_s``) or a resumed
      stream is always local.
    * A local request generates ``max_tokens`` tokens, token ``base_token + i`` at
      position ``i`` (a resumed one from position ``len(resume)``: the continuation the
      first worker would have made), one output per loop turn; with ``hold_after``, it
      stops after that many outputs until aborted (a stream in flight) or ``release`` is
      set. A ``sink`` given to ``admit`` takes the outputs as `AsyncEngine`'s does.
    * A prefill (unless ``answer_prefills`` is False: then it computes until aborted)
      fills page ``j`` of its prompt with ``j + 1`` everywhere, samples ``first_token``
      and keeps the pages under a lease (no expiry) until `release_lease`.
    * ``activate_remote`` outputs the prefill worker's first token, then the tokens at
      positions 1.. as above; it keeps a copy of the reserved pages' KV as they were
      then (``activated_kv``) to show what the transfer delivered.

    ``calls`` records every operation in order; `ops` gives one request's.
    """

    def __init__(
        self,
        *,
        num_pages: int = 16,
        base_token: int = 100,
        first_token: int = 7,
        hold_after: int | None = None,
        answer_prefills: bool = True,
    ) -> None:
        self.release = asyncio.Event()  # lets held streams go on
        kv = torch.zeros(1, 2, num_pages, PAGE_SIZE, 1, 2)  # (L, 2, P, page_size, H, D)
        self.loras = SimpleNamespace(adapters={})  # `Engine.loras`: no LoRA adapter
        self.info = EngineInfo(
            model_name=MODEL,
            served_name=MODEL,
            max_model_len=256,
            vocab_size=1000,
            page_size=PAGE_SIZE,
            prefix_cache=False,
            hash_namespace=NAMESPACE,
            geometry=PoolCompat.of(kv, MODEL),
            kv_shard=KVShard.whole(1),
            kv=kv,
            tokenizer=None,  # type: ignore[arg-type]  # no service here reads it
        )
        self.num_pages = num_pages
        self.base_token, self.first_token = base_token, first_token
        self.hold_after = hold_after
        self.answer_prefills = answer_prefills
        self.calls: list[EngineCall] = []
        self.free_pages = list(range(num_pages))
        self.reserved: dict[str, list[int]] = {}  # remote route, waiting for the KV
        self.leases: dict[str, list[int]] = {}  # prefills, waiting for their reader
        self.activated_kv: dict[str, torch.Tensor] = {}
        self._requests: dict[str, _Request] = {}

    # -- what tests read ---------------------------------------------------------------

    def ops(self, request_id: str) -> list[str]:
        """The operations asked for ``request_id``, in order."""
        return [c.op for c in self.calls if c.request_id == request_id]

    def args(self, op: str, request_id: str) -> list[Mapping[str, Any]]:
        """The arguments of each ``op`` call for ``request_id``, in order."""
        return [c.args for c in self.calls if c.op == op and c.request_id == request_id]

    def pages_in_use(self) -> int:
        return self.num_pages - len(self.free_pages)

    # -- the AsyncEngine operations ----------------------------------------------------

    def stats(self) -> EngineStats:
        running = sum(1 for r in self._requests.values() if r.task is not None)
        return EngineStats(running=running, leases=len(self.leases))

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
    ) -> tuple[Admission, asyncio.Queue]:
        ids, resumed = list(prompt_ids), list(resume)
        local = lease_s is not None or bool(resumed)
        route = "local" if local else choose_route(len(ids), 0, 0, remote_over)
        self._record(
            "admit",
            request_id,
            prompt_len=len(ids),
            remote_over=remote_over,
            lease_s=lease_s,
            resume=resumed,
            route=route,
            cache_scope=cache_scope,
            share=share,
            adapter=adapter,
        )
        req = _Request(len(ids), params.max_tokens, asyncio.Queue(), sink=sink)
        self._requests[request_id] = req
        if route == "remote":
            req.pages = self._take(-(-len(ids) // PAGE_SIZE))
            self.reserved[request_id] = req.pages
            return Admission(request_id, "remote", 0, tuple(req.pages)), req.out
        if lease_s is not None:
            req.task = asyncio.create_task(self._prefill(request_id, ids, req))
        else:
            req.task = asyncio.create_task(self._generate(request_id, req, len(resumed)))
        return Admission(request_id, "local", 0), req.out

    async def call(self, fn: Callable[[Any], Any], watch: str | None = None) -> tuple[Any, None]:
        """`AsyncEngine.call`: ``fn`` on this engine (its LoRA adapters: none)."""
        return fn(self), None

    def finish_host_admission(self, request_id: str, ok: bool, disk_pages: int = 0) -> None:
        self._record("finish_host_admission", request_id, ok=ok)

    def activate_remote(
        self,
        request_id: str,
        first_tokens: Sequence[int],
        cached: CachedTokens,
        first_logprobs: Sequence[TokenLogprob] = (),
        prompt_logprobs: Sequence[TokenLogprob] | None = None,
    ) -> None:
        self._record("activate_remote", request_id, first_tokens=list(first_tokens), cached=cached)
        req = self._requests[request_id]
        pages = self.reserved.pop(request_id)
        self.activated_kv[request_id] = self.info.kv[:, :, pages].clone()
        last = req.max_tokens == 1
        req.put(self._output(request_id, req, first_tokens[0], 0, last))
        if not last:
            req.task = asyncio.create_task(self._generate(request_id, req, 1))

    def release_lease(self, request_id: str) -> None:
        self._record("release_lease", request_id)
        self._free(self.leases.pop(request_id, []))

    def abort(self, request_id: str) -> None:
        self._record("abort", request_id)
        self._end(request_id)

    async def abort_now(self, request_id: str) -> None:
        self._record("abort_now", request_id)
        self._end(request_id)

    outputs = AsyncEngine.outputs  # the real iterator: leaving it early aborts

    def listen_cache(self, on_event: Callable[[str, list[int]], None] | None) -> None:
        self._record("listen_cache", "")

    def resync_cache(self, emit: Callable[[str, list[int]], None]) -> None:
        self._record("resync_cache", "")

    def listen_spills(
        self, on_spill: Any, write_through_uses: int = 0, buffer: Any = None, path: Any = None
    ) -> None:
        self._record("listen_spills", "")

    def close(self) -> None:
        self._record("close", "")
        for request_id in list(self._requests):
            self._end(request_id)

    # -- the fake's own work -----------------------------------------------------------

    def _record(self, op: str, request_id: str, **args: Any) -> None:
        self.calls.append(EngineCall(op, request_id, args))

    def _take(self, n: int) -> list[int]:
        assert len(self.free_pages) >= n, "the fake engine's pool is too small for the test"
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return pages

    def _free(self, pages: list[int]) -> None:
        self.free_pages.extend(pages)

    def _end(self, request_id: str) -> None:
        """Stop the request's work and free what it holds (a lease stays: it is the
        reader's until `release_lease`)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if req.task is not None and req.task is not asyncio.current_task():
            req.task.cancel()
        self.reserved.pop(request_id, None)
        if request_id not in self.leases:
            self._free(req.pages)

    def _output(
        self,
        request_id: str,
        req: _Request,
        token: int,
        position: int,
        last: bool,
        leased: list[int] | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[token],
            new_text="",
            finished=last,
            finish_reason="length" if last else None,
            prompt_tokens=req.prompt_len,
            completion_tokens=position + 1,
            ttft_ms=1.0,
            leased_page_ids=leased,
        )

    async def _generate(self, request_id: str, req: _Request, start: int) -> None:
        for emitted, position in enumerate(range(start, req.max_tokens)):
            if emitted == self.hold_after:
                await self.release.wait()
            await asyncio.sleep(0)  # one output per loop turn, as one per engine step
            last = position == req.max_tokens - 1
            token = self.base_token + position
            req.put(self._output(request_id, req, token, position, last))
        self._end(request_id)

    async def _prefill(self, request_id: str, ids: list[int], req: _Request) -> None:
        if not self.answer_prefills:
            await _until_cancelled()
        req.pages = self._take(-(-len(ids) // PAGE_SIZE))
        for j, page in enumerate(req.pages):
            self.info.kv[:, :, page] = float(j + 1)
        self.leases[request_id] = req.pages
        output = self._output(request_id, req, self.first_token, 0, True, list(req.pages))
        req.out.put_nowait(output)
        self._end(request_id)


async def _until_cancelled() -> None:
    await asyncio.get_running_loop().create_future()


# -- the harness ----------------------------------------------------------------------


def run_scenario(
    scenario: Callable[[zmq.asyncio.Context], Awaitable[None]], timeout_s: float = 20.0
) -> None:
    """Run ``scenario`` on a fresh event loop with a ZMQ context for the test's own
    sockets, failing it past ``timeout_s``; the context is destroyed after (linger 0)."""

    async def main() -> None:
        context = zmq.asyncio.Context()
        try:
            await asyncio.wait_for(scenario(context), timeout_s)
        finally:
            context.destroy(linger=0)

    asyncio.run(main())


async def until(condition: Callable[[], object], what: str, timeout_s: float = 5.0) -> None:
    """Wait until ``condition()`` is true; AssertionError naming ``what`` past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.005)


@dataclass
class Running:
    """A service running on the test's loop: set ``stop`` to stop it (SIGINT: at once);
    ``task`` is done once it has closed everything."""

    task: asyncio.Task
    stop: asyncio.Event


@contextlib.asynccontextmanager
async def serving(service: Service) -> AsyncIterator[Running]:
    """Run ``service`` on this loop (bound to a free port on 127.0.0.1) for the block;
    then stop it, if it has not stopped by itself, and wait until it has closed
    everything."""
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await until(lambda: service.serving or task.done(), f"{service.role} to serve")
        if task.done():
            task.result()  # raise why it did not start
        yield Running(task, stop)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


class PeerSocket:
    """A DEALER socket a test speaks the protocol on: a gateway to a decode worker, a
    decode worker to a prefill worker. Heartbeats it receives are skipped; it sends
    none (the service drops it after ``peer_timeout_s`` of silence)."""

    def __init__(
        self, context: zmq.asyncio.Context, address: str, keys: ClusterKeys | None = None
    ) -> None:
        self.channel = AsyncChannel.open(context, zmq.DEALER, address, bind=False, keys=keys)
        self.ack: HelloAck | None = None  # the service's answer to `hello`

    async def hello(self, name: str, role: str) -> HelloAck:
        await self.send(Hello(name, role, 1))  # type: ignore[arg-type]
        self.ack = await self.recv(HelloAck)
        return self.ack

    async def send(self, msg: Message) -> None:
        await self.channel.send(msg, timeout_ms=2000)

    async def recv(self, *types: type[M], timeout_s: float = 5.0) -> M:
        """The next message that is not a heartbeat; AssertionError if it is not one of
        ``types`` or none comes in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            msg = await self.channel.recv(timeout_ms=left_ms)
            if msg is None:
                raise AssertionError(f"no {[t.__name__ for t in types]} within {timeout_s} s")
            if isinstance(msg, Heartbeat):
                continue
            assert isinstance(msg, types), f"expected {[t.__name__ for t in types]}, got {msg}"
            return msg  # type: ignore[return-value]

    async def stream(self, request_id: str) -> tuple[list[int], RequestFailed | None]:
        """The tokens of ``request_id`` until its finished chunk, or until it fails."""
        tokens: list[int] = []
        while True:
            msg = await self.recv(TokenChunk, RequestFailed)
            assert msg.request_id == request_id, msg
            if isinstance(msg, RequestFailed):
                return tokens, msg
            tokens.extend(msg.token_ids)
            if msg.finished:
                return tokens, None

    def close(self) -> None:
        self.channel.close()


OnMessage = Callable[["FakePeer", bytes, Message], Awaitable[None]]


class FakePeer:
    """A ROUTER standing in for a worker process whose answers a test scripts: it
    answers `Hello` with ``ack`` and each `Heartbeat` with its own (``load``), records
    every other message in ``received`` and hands it to ``on_message``. `close` is the
    process dying: its socket closes, and with it every connection."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        ack: HelloAck,
        on_message: OnMessage | None = None,
        load: WorkerLoad | None = None,
        stats: ServiceStats | None = None,
    ) -> None:
        self.ack = ack
        self.load = load or WorkerLoad()
        self.stats = stats or ServiceStats()  # in its heartbeats (its LoRA adapters...)
        self.on_message = on_message
        self.received: list[Message] = []
        self.channel = AsyncChannel.open(context, zmq.ROUTER, "tcp://127.0.0.1:*", bind=True)
        self.address = self.channel.endpoint
        self._task = asyncio.create_task(self._serve())

    def of_type(self, kind: type[M]) -> list[M]:
        return [m for m in self.received if isinstance(m, kind)]

    async def send_to(self, identity: bytes, msg: Message) -> None:
        await self.channel.send_to(identity, msg, timeout_ms=1000)

    async def _serve(self) -> None:
        while True:
            got = await self.channel.recv_from()
            if got is None:
                continue
            identity, msg = got
            if isinstance(msg, Hello):
                await self.send_to(identity, self.ack)
            elif isinstance(msg, Heartbeat):
                beat = Heartbeat(self.ack.name, self.ack.generation, self.load, self.stats)
                await self.send_to(identity, beat)
            else:
                self.received.append(msg)
                if self.on_message is not None:
                    await self.on_message(self, identity, msg)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.channel.close()
