"""The decode worker in-process, over a fake engine (`tests.fake_engine`), driven by a
test socket speaking the protocol as the gateway: a short delta is prefilled locally
with the gateway's page hashes (hashed here only when none came), a long prompt is
prefilled on a prefill worker whose pages move through real ZMQ transfer agents, a
prefill worker that refuses because it is draining sends the prompt to the next one,
one that never answers ends in a local recompute (or a failure, as configured) with the
reservation returned, and the gateway's Abort aborts the engine's request."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
import zmq.asyncio

from radixserve.cache.block_hash import cache_scope, page_hashes, scoped_namespace
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.wire import to_spec
from radixserve.protocol import (
    Abort,
    GenerateRequest,
    HelloAck,
    KVReady,
    Message,
    PrefillRequest,
    RequestFailed,
    TokenChunk,
    WatchMembers,
)
from radixserve.protocol.lora_messages import LoraAdapterInfo
from radixserve.protocol.peer_messages import PeerRead
from radixserve.protocol.stats_messages import ServiceStats
from radixserve.services.decode.settings import DecodeSettings
from radixserve.services.decode.worker import DecodeWorker, _Adapter
from radixserve.services.prefill.settings import PrefillSettings
from radixserve.services.prefill.worker import PrefillWorker
from tests.fake_engine import (
    NAMESPACE,
    PAGE_SIZE,
    FakeEngine,
    FakePeer,
    PeerSocket,
    run_scenario,
    serving,
    until,
)

LOCAL_MAX = 8  # local_prefill_max_tokens
SHORT = tuple(range(1, 9))  # 8 tokens, 2 pages: at most LOCAL_MAX uncached, local
LONG = tuple(range(1, 13))  # 12 tokens, 3 pages: remote
SAMPLING = to_spec(SamplingParams(max_tokens=4, temperature=0.0))
LOCAL_TOKENS = [100, 101, 102, 103]  # the decode engine's tokens at positions 0..3
REMOTE_TOKENS = [7, 101, 102, 103]  # the prefill worker's first token, then the decode's


def request(rid: str, prompt: tuple[int, ...], carry_hashes: bool = True) -> GenerateRequest:
    hashes = tuple(page_hashes(prompt, PAGE_SIZE, NAMESPACE)) if carry_hashes else ()
    return GenerateRequest(rid, prompt, SAMPLING, page_hashes=hashes)


def prefill_peer(context: zmq.asyncio.Context, name: str, on_message: Any = None) -> FakePeer:
    ack = HelloAck(name, "prefill", 1, page_size=PAGE_SIZE, hash_namespace=NAMESPACE)
    return FakePeer(context, ack, on_message)


async def refuse_draining(peer: FakePeer, identity: bytes, msg: Message) -> None:
    """A prefill worker that began draining after the decode worker picked it."""
    if isinstance(msg, PrefillRequest):
        await peer.send_to(identity, RequestFailed(msg.request_id, "draining", "draining"))


def prefill_worker(engine: FakeEngine, name: str = "p1") -> PrefillWorker:
    settings = PrefillSettings(name=name, transfer_backend="zmq", heartbeat_interval_s=0.05)
    return PrefillWorker(settings, engine)


@contextlib.asynccontextmanager
async def decode_worker(
    context: zmq.asyncio.Context, engine: FakeEngine, prefills: list[str], **settings: Any
) -> AsyncIterator[tuple[DecodeWorker, PeerSocket]]:
    """A decode worker linked to ``prefills`` (all up before the block), and the
    gateway's socket to it, past the handshake."""
    worker = DecodeWorker(
        DecodeSettings(
            transfer_backend="zmq",
            prefill_workers=prefills,
            heartbeat_interval_s=0.05,
            local_prefill_max_tokens=LOCAL_MAX,
            **settings,
        ),
        engine,
    )
    async with serving(worker):
        assert worker.prefills is not None
        await until(lambda: len(worker.prefills.ready()) == len(prefills), "prefill links up")
        gateway = PeerSocket(context, worker.address)
        try:
            ack = await gateway.hello("gateway-test", "gateway")
            assert (ack.role, ack.page_size, ack.hash_namespace) == ("decode", PAGE_SIZE, NAMESPACE)
            yield worker, gateway
        finally:
            gateway.close()


def counters(worker: DecodeWorker) -> dict[str, int]:
    names = (
        "local_prefills_total",
        "remote_prefills_total",
        "remote_prefill_failures_total",
        "prompt_hashes_total",
    )
    return {name: worker.counters[name] for name in names}


@pytest.mark.parametrize(
    ("carry", "hashed"), [(True, 0), (False, 1)], ids=["hashes carried", "no hashes"]
)
def test_a_short_delta_is_prefilled_locally_and_hashed_at_most_once(
    carry: bool, hashed: int
) -> None:
    """With a prefill worker up, a prompt whose uncached part is within
    ``local_prefill_max_tokens`` is computed here (the engine was offered the remote
    route and chose local); the gateway's page hashes are used as they came, and a
    request that carried none is hashed here exactly once."""
    seen: dict[str, Any] = {}

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine()
        peer = prefill_peer(context, "p0")
        try:
            async with decode_worker(context, engine, [peer.address]) as (worker, gateway):
                await gateway.send(request("r1", SHORT, carry_hashes=carry))
                seen["stream"] = await gateway.stream("r1")
                seen["ops"] = engine.ops("r1")
                seen["admits"] = [dict(a) for a in engine.args("admit", "r1")]
                seen["counters"] = counters(worker)
            seen["prefill"] = list(peer.received)
        finally:
            await peer.close()

    run_scenario(scenario)
    assert seen["stream"] == (LOCAL_TOKENS, None)
    assert seen["ops"] == ["admit"]
    assert [(a["remote_over"], a["route"]) for a in seen["admits"]] == [(LOCAL_MAX, "local")]
    assert seen["counters"] == {
        "local_prefills_total": 1,
        "remote_prefills_total": 0,
        "remote_prefill_failures_total": 0,
        "prompt_hashes_total": hashed,
    }
    assert seen["prefill"] == []  # no PrefillRequest, no Abort


def test_a_long_prompt_is_prefilled_remotely_and_its_pages_pulled() -> None:
    """A prompt past ``local_prefill_max_tokens`` gets pages reserved, is computed on the
    prefill worker, whose pages land in the reservation (real ZMQ agents) before the
    request is activated; the stream is the prefill worker's first token, then the
    decode engine's; TransferDone releases the prefill worker's lease."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        prefill_engine, engine = FakeEngine(first_token=7), FakeEngine(base_token=100)
        prefill = prefill_worker(prefill_engine)
        async with (
            serving(prefill),
            decode_worker(context, engine, [prefill.address]) as (worker, gateway),
        ):
            await gateway.send(request("r1", LONG))
            tokens, failed = await gateway.stream("r1")
            assert (tokens, failed) == (REMOTE_TOKENS, None)
            await until(lambda: "release_lease" in prefill_engine.ops("r1"), "TransferDone")
            assert engine.ops("r1") == ["admit", "activate_remote"]
            [admit] = engine.args("admit", "r1")
            assert (admit["remote_over"], admit["route"]) == (LOCAL_MAX, "remote")
            [activate] = engine.args("activate_remote", "r1")
            assert activate["first_tokens"] == [7]
            # page j of the prompt holds j + 1 on the prefill side: so it did here
            # when the request was activated
            kv = engine.activated_kv["r1"]  # (L, 2, 3 pages, page_size, H, D)
            want = torch.arange(1.0, 4.0).view(1, 1, 3, 1, 1, 1).expand_as(kv)
            assert torch.equal(kv, want)
            assert prefill_engine.ops("r1") == ["admit", "release_lease"]
            assert prefill_engine.args("admit", "r1")[0]["lease_s"] == 60.0
            assert prefill_engine.leases == {}
            assert counters(worker) == {
                "local_prefills_total": 0,
                "remote_prefills_total": 1,
                "remote_prefill_failures_total": 0,
                "prompt_hashes_total": 0,
            }
            assert worker.counters["kv_transfer_pages_total"] == 3
            await until(lambda: engine.pages_in_use() == 0, "the request's pages freed")

    run_scenario(scenario)


def test_a_prefill_worker_refusing_as_draining_sends_the_prompt_to_the_next_one() -> None:
    """The prefill worker picked first (p0: the name breaks the tie) answers
    RequestFailed "draining": no failure; the reservation is returned, p0 is told to
    abort, and the prompt is admitted again and prefilled on p1."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        prefill_engine, engine = FakeEngine(first_token=7), FakeEngine(base_token=100)
        p0 = prefill_peer(context, "p0", refuse_draining)
        p1 = prefill_worker(prefill_engine, "p1")
        try:
            async with (
                serving(p1),
                decode_worker(context, engine, [p0.address, p1.address]) as (worker, gateway),
            ):
                await gateway.send(request("r1", LONG))
                tokens, failed = await gateway.stream("r1")
                assert (tokens, failed) == (REMOTE_TOKENS, None)
                assert engine.ops("r1") == ["admit", "abort_now", "admit", "activate_remote"]
                await until(lambda: len(p0.received) == 2, "p0 to be told to abort")
                assert [(type(m), m.request_id) for m in p0.received] == [  # type: ignore[attr-defined]
                    (PrefillRequest, "r1"),
                    (Abort, "r1"),
                ]
                assert prefill_engine.ops("r1")[0] == "admit"
                assert counters(worker) == {
                    "local_prefills_total": 0,
                    "remote_prefills_total": 1,
                    "remote_prefill_failures_total": 0,
                    "prompt_hashes_total": 0,
                }
        finally:
            await p0.close()

    run_scenario(scenario)


def _silent_prefill_scenario(on_transfer_failure: str) -> dict[str, Any]:
    """A long prompt against a prefill worker that never answers (prefill_timeout_s
    0.2); what the gateway, the engine and the prefill worker saw."""
    seen: dict[str, Any] = {}

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine(base_token=100)
        p0 = prefill_peer(context, "p0")
        try:
            async with decode_worker(
                context,
                engine,
                [p0.address],
                prefill_timeout_s=0.2,
                on_transfer_failure=on_transfer_failure,
            ) as (worker, gateway):
                await gateway.send(request("r1", LONG))
                seen["tokens"], seen["failed"] = await gateway.stream("r1")
                await until(lambda: len(p0.received) == 2, "p0 to be told to abort")
                seen["p0"] = [(type(m), m.request_id) for m in p0.received]  # type: ignore[attr-defined]
                seen["ops"] = engine.ops("r1")
                seen["admits"] = [dict(a) for a in engine.args("admit", "r1")]
                seen["counters"] = counters(worker)
                seen["reserved"] = dict(engine.reserved)
                await until(lambda: engine.pages_in_use() == 0, "the reservation freed")
        finally:
            await p0.close()

    run_scenario(scenario)
    return seen


def test_a_prefill_worker_that_never_answers_ends_in_a_local_recompute() -> None:
    """Past ``prefill_timeout_s`` the reservation is aborted (abort_now, once), the
    prefill worker is told to abort, and the prompt is computed here: the gateway sees
    the decode engine's own tokens; one remote prefill failure is counted."""
    seen = _silent_prefill_scenario("recompute")
    assert (seen["tokens"], seen["failed"]) == (LOCAL_TOKENS, None)
    assert seen["ops"] == ["admit", "abort_now", "admit"]
    assert [(a["remote_over"], a["route"]) for a in seen["admits"]] == [
        (LOCAL_MAX, "remote"),
        (None, "local"),
    ]
    assert seen["p0"] == [(PrefillRequest, "r1"), (Abort, "r1")]
    assert seen["reserved"] == {}
    assert seen["counters"] == {
        "local_prefills_total": 1,
        "remote_prefills_total": 0,
        "remote_prefill_failures_total": 1,
        "prompt_hashes_total": 0,
    }


def test_a_prefill_timeout_fails_the_request_when_configured_to() -> None:
    """With ``on_transfer_failure="fail"`` the same timeout returns the reservation and
    answers the gateway RequestFailed ("timeout") instead of recomputing."""
    seen = _silent_prefill_scenario("fail")
    assert seen["tokens"] == []
    failed = seen["failed"]
    assert isinstance(failed, RequestFailed)
    assert (failed.request_id, failed.error_type) == ("r1", "timeout")
    assert seen["ops"] == ["admit", "abort_now"]
    assert seen["p0"] == [(PrefillRequest, "r1"), (Abort, "r1")]
    assert seen["counters"] == {
        "local_prefills_total": 0,
        "remote_prefills_total": 0,
        "remote_prefill_failures_total": 1,
        "prompt_hashes_total": 0,
    }


def test_an_abort_from_the_gateway_mid_stream_aborts_the_engine_request() -> None:
    """The engine holds the stream after its first token; the gateway's Abort ends the
    request's task and, through the output iterator, aborts it in the engine once."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine(base_token=100, hold_after=1)
        async with decode_worker(context, engine, []) as (worker, gateway):
            await gateway.send(request("r1", SHORT))
            first = await gateway.recv(TokenChunk)
            assert (first.request_id, first.token_ids, first.finished) == ("r1", (100,), False)
            await gateway.send(Abort("r1"))
            await until(lambda: not worker.tasks, "the request's task to end")
            assert engine.ops("r1") == ["admit", "abort"]
            assert engine.stats().running == 0
            assert counters(worker)["local_prefills_total"] == 1

    run_scenario(scenario)


def test_a_message_the_decode_worker_does_not_take_is_logged_and_it_serves_on(caplog) -> None:
    """A `WatchMembers` (the kvstore's message) on the decode worker's socket has no
    handler in its table: it is logged, naming it and its sender, and changes nothing."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        async with decode_worker(context, FakeEngine(base_token=100), []) as (_, gateway):
            await gateway.send(WatchMembers(("decode",)))
            await gateway.send(request("r1", SHORT))
            assert await gateway.stream("r1") == (LOCAL_TOKENS, None)

    run_scenario(scenario)
    assert "unexpected WatchMembers from gateway-test" in caplog.text


def test_every_counter_is_exported_at_zero_before_its_first_event() -> None:
    """A dashboard's rate() needs the series before the first transfer: a decode worker
    that has moved nothing still exports its transfer summary and prefill counters, at 0."""
    worker = DecodeWorker(DecodeSettings(transfer_backend="zmq"), FakeEngine())
    text = worker.metrics_text().decode()
    for name in ("radixserve_kv_transfer_seconds_count", "radixserve_kv_transfer_seconds_sum",
                 "radixserve_worker_kv_transfer_pages_total",
                 "radixserve_worker_remote_prefills_total",
                 "radixserve_worker_local_prefills_total"):  # fmt: skip
        [line] = [x for x in text.splitlines() if x.startswith(name + "{")]
        assert line.endswith(" 0.0"), line


def test_a_scoped_request_keeps_its_cache_scope_on_both_workers() -> None:
    """The request's cache scope reaches the decode engine's admission and, on the remote
    route, the prefill engine's: both cache and match its pages in that scope only."""
    scope = cache_scope(tenant="acme", salt="conversation-7")

    async def scenario(context: zmq.asyncio.Context) -> None:
        prefill_engine, engine = FakeEngine(first_token=7), FakeEngine(base_token=100)
        prefill = prefill_worker(prefill_engine)
        async with (
            serving(prefill),
            decode_worker(context, engine, [prefill.address]) as (_, gateway),
        ):
            hashes = tuple(page_hashes(LONG, PAGE_SIZE, scoped_namespace(NAMESPACE, scope)))
            await gateway.send(
                GenerateRequest("r1", LONG, SAMPLING, page_hashes=hashes, cache_scope=scope)
            )
            assert await gateway.stream("r1") == (REMOTE_TOKENS, None)
            assert engine.args("admit", "r1")[0]["cache_scope"] == scope
            assert prefill_engine.args("admit", "r1")[0]["cache_scope"] == scope
            await until(lambda: engine.pages_in_use() == 0, "the request's pages freed")

    run_scenario(scenario)


def test_a_prefill_request_carries_the_hashes_and_a_run_out_lease_is_not_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The prefill worker gets the prompt's page hashes (it hashes nothing again); a
    KVReady whose lease has run out (``lease_ms`` 0) is not read: the reservation is
    given back, the prefill worker told, and the prompt computed here."""
    seen: dict[str, Any] = {}

    async def answer_expired(peer: FakePeer, identity: bytes, msg: Message) -> None:
        if isinstance(msg, PrefillRequest):
            seen["hashes"] = msg.page_hashes
            ready = KVReady(msg.request_id, (7,), src_page_ids=(0, 1, 2), lease_ms=0.0)
            await peer.send_to(identity, ready)

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine(base_token=100)
        p0 = prefill_peer(context, "p0", answer_expired)
        try:
            async with decode_worker(context, engine, [p0.address]) as (worker, gateway):
                await gateway.send(request("r1", LONG))
                seen["tokens"], seen["failed"] = await gateway.stream("r1")
                seen["ops"] = engine.ops("r1")
                seen["failures"] = worker.counters["remote_prefill_failures_total"]
                seen["read"] = worker.counters["kv_transfers_total"]
                await until(lambda: engine.pages_in_use() == 0, "the reservation freed")
        finally:
            await p0.close()

    run_scenario(scenario)
    assert seen["hashes"] == tuple(page_hashes(LONG, PAGE_SIZE, NAMESPACE))
    assert (seen["tokens"], seen["failed"]) == (LOCAL_TOKENS, None)
    assert seen["ops"] == ["admit", "abort_now", "admit"]
    assert (seen["failures"], seen["read"]) == (1, 0)
    assert "(the prefill worker's lease on the pages ran out)" in caplog.text  # no read began


def test_pages_computed_with_another_lora_adapter_are_not_read(caplog) -> None:
    """A request of LoRA adapter "a" goes only to a prefill worker whose heartbeat states
    "a" with this worker's content; one that answers `KVReady` with pages of another
    content (a peer that ignored the adapter) is told to abort, its pages are not read,
    and the prompt is recomputed here (for that reason: the peer has no transfer agent, so
    a read would fail too)."""
    mine, other = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    adapter = LoraAdapterInfo("a", mine, scoped_namespace(NAMESPACE, "adapter a"))

    async def answer_other(peer: FakePeer, identity: bytes, msg: Message) -> None:
        if isinstance(msg, PrefillRequest):
            assert (msg.adapter, msg.adapter_fingerprint) == ("a", mine)
            await peer.send_to(identity, KVReady(msg.request_id, (7,), (0, 1, 2),
                                                 adapter_fingerprint=other))  # fmt: skip

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine(base_token=100)
        p0 = prefill_peer(context, "p0", answer_other)
        p0.stats = ServiceStats(loras=(adapter,))
        try:
            async with decode_worker(context, engine, [p0.address]) as (worker, gateway):
                worker.loras.adopt([adapter])
                await until(lambda: worker.prefills is not None and worker._prefills_ready(
                    frozenset(), _Adapter("a", mine)) != [], "p0 to state the adapter")  # fmt: skip
                await gateway.send(GenerateRequest("r1", LONG, SAMPLING, adapter="a",
                                                   adapter_fingerprint=mine))  # fmt: skip
                tokens, failed = await gateway.stream("r1")
                assert (tokens, failed) == (LOCAL_TOKENS, None)
                assert engine.ops("r1") == ["admit", "abort_now", "admit"]
                assert all(a["adapter"] == "a" for a in engine.args("admit", "r1"))
                await until(lambda: len(p0.received) == 2, "p0 to be told to abort")
                assert [type(m) for m in p0.received] == [PrefillRequest, Abort]
                assert worker.counters["kv_transfer_pages_total"] == 0
                assert counters(worker)["remote_prefill_failures_total"] == 1
                await until(lambda: engine.pages_in_use() == 0, "the reservation freed")
        finally:
            await p0.close()

    run_scenario(scenario)
    [why] = [r.getMessage() for r in caplog.records if "recomputing locally" in r.getMessage()]
    assert f"LoRA adapter fingerprint '{other}', the request's is '{mine}'" in why


def test_a_peer_read_for_another_adapters_pages_is_refused_and_lends_nothing() -> None:
    """A `PeerRead` whose adapter fingerprint is not this worker's adapter's (or names
    an adapter it does not serve) is refused: a cached page serves only the adapter that
    computed it (the engine is never asked)."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        async with decode_worker(context, FakeEngine(base_token=100), []) as (worker, peer):
            worker.loras.adopt([LoraAdapterInfo("a", "sha256:" + "1" * 64, b"n" * 32)])
            for adapter, fingerprint in (("a", "sha256:" + "2" * 64), ("b", "sha256:" + "1" * 64)):
                await peer.send(PeerRead(f"r-{adapter}", (1, 2, 3), 0, 1, "", adapter, fingerprint))
                refused = await peer.recv(RequestFailed)
                assert refused.request_id == f"r-{adapter}" and "LoRA adapter" in refused.message
            assert worker.lending.readers == {}

    run_scenario(scenario)
