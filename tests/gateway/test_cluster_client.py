"""The gateway's cluster client in-process, against decode workers on 127.0.0.1: fake
ones whose answers the tests script (`tests.fake_engine.FakePeer`) and real decode
workers over fake engines. It sends requests to decode workers only, carrying the
prompt's page hashes; a refusal as draining goes to another worker; a stream whose
worker dies or drains past its grace continues on another from the tokens already
streamed; a worker's RequestFailed becomes the caller's error; a worker with other
pages is never linked."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import zmq.asyncio

from radixserve.cache.block_hash import cache_scope, hash_namespace, page_hashes, scoped_namespace
from radixserve.engine.fair_share import TenantShare
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.wire import to_share
from radixserve.errors import CapacityError, InvalidRequestError, UnavailableError
from radixserve.model.identity import ModelIdentity
from radixserve.protocol import (
    GenerateRequest,
    Heartbeat,
    HelloAck,
    Message,
    RequestFailed,
    TokenChunk,
    WorkerLoad,
)
from radixserve.protocol.cached_tokens import CachedTokens
from radixserve.protocol.fields import ErrorType
from radixserve.runtime.routing.cluster_client import ClusterClient
from radixserve.services.decode.settings import DecodeSettings
from radixserve.services.decode.worker import DecodeWorker
from radixserve.services.gateway.settings import GatewaySettings
from tests.fake_engine import (
    MODEL,
    NAMESPACE,
    PAGE_SIZE,
    FakeEngine,
    FakePeer,
    OnMessage,
    run_scenario,
    serving,
    until,
)

PROMPT = list(range(1, 9))  # 8 tokens: 2 full pages
HASHES = tuple(page_hashes(PROMPT, PAGE_SIZE, NAMESPACE))
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
TOKENS = [5, 6, 7, 8]  # what every fake decode worker generates for PROMPT


def decode_script(
    stop_after: int | None = None,
    then: ErrorType | None = None,
    refuse: ErrorType | None = None,
    cached: int = 0,
) -> OnMessage:
    """A decode worker answering a GenerateRequest: ``refuse`` at once with that error,
    or stream TOKENS past the request's ``resume_token_ids``; with ``stop_after``, only
    that many, then fail with ``then`` (None: go quiet, e.g. until the test kills it).
    ``cached``: prompt tokens its chunks say were cached, all of them from the disk tier."""

    async def answer(peer: FakePeer, identity: bytes, msg: Message) -> None:
        if not isinstance(msg, GenerateRequest):
            return
        rid = msg.request_id
        if refuse is not None:
            await peer.send_to(identity, RequestFailed(rid, refuse, f"{peer.ack.name} refuses"))
            return
        todo = TOKENS[len(msg.resume_token_ids) :]
        for i, token in enumerate(todo[:stop_after]):
            last = i == len(todo) - 1
            chunk = TokenChunk(
                rid,
                (token,),
                finished=last,
                finish_reason="length" if last else None,
                prompt_tokens=len(msg.prompt_token_ids),
                cached=CachedTokens(disk=cached),
            )
            await peer.send_to(identity, chunk)
        if stop_after is not None and then is not None:
            if then == "draining":  # as a real drain: its heartbeat says so at once
                peer.load = WorkerLoad(draining=True)
                await peer.send_to(
                    identity, Heartbeat(peer.ack.name, peer.ack.generation, peer.load)
                )
            await peer.send_to(identity, RequestFailed(rid, then, "drain grace is over"))

    return answer


def decode_peer(
    context: zmq.asyncio.Context,
    name: str,
    script: OnMessage,
    page_size: int = PAGE_SIZE,
    namespace: bytes = NAMESPACE,
) -> FakePeer:
    ack = HelloAck(
        name,
        "decode",
        1,
        model_name=MODEL,
        max_model_len=256,
        page_size=page_size,
        hash_namespace=namespace,
    )
    return FakePeer(context, ack, script)


@contextlib.asynccontextmanager
async def cluster_client(
    decodes: list[str], prefills: Sequence[str] = (), **settings: Any
) -> AsyncIterator[ClusterClient]:
    """A started cluster client linked to these workers; shut down after the block."""
    client = ClusterClient(
        GatewaySettings(
            decode_workers=decodes,
            prefill_workers=list(prefills),
            heartbeat_interval_s=0.05,
            migration_wait_s=3.0,
            **settings,
        ),
        tokenizer=None,  # type: ignore[arg-type]  # generate() takes token ids
        model_name=MODEL,
        max_model_len=256,
        page_size=PAGE_SIZE,
        hash_namespace=NAMESPACE,
    )
    await client.start()
    try:
        yield client
    finally:
        await client.shutdown()


async def decodes_ready(client: ClusterClient, n: int) -> None:
    assert client.decodes is not None
    await until(lambda: len(client.decodes.ready()) == n, f"{n} decode workers up")


async def generate(client: ClusterClient, rid: str = "r1") -> list[RequestOutput]:
    return [output async for output in client.generate(PROMPT, PARAMS, rid)]


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for output in outputs for t in output.new_token_ids]


def sent(peer: FakePeer) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(request id, page hashes, resume tokens) of each GenerateRequest ``peer`` got."""
    return [
        (m.request_id, m.page_hashes, m.resume_token_ids) for m in peer.of_type(GenerateRequest)
    ]


def test_requests_go_to_decode_workers_only_with_the_prompts_page_hashes() -> None:
    """A linked prefill worker gets nothing; the decode worker gets the prompt and its
    page hashes, computed once; the caller gets the decode worker's stream."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        d0 = decode_peer(context, "d0", decode_script())
        p0 = FakePeer(
            context, HelloAck("p0", "prefill", 1, page_size=PAGE_SIZE, hash_namespace=NAMESPACE)
        )
        try:
            async with cluster_client([d0.address], [p0.address]) as client:
                await decodes_ready(client, 1)
                assert client.prefills is not None
                await until(lambda: len(client.prefills.up()) == 1, "the prefill link up")
                outputs = await generate(client)
                assert tokens_of(outputs) == TOKENS and outputs[-1].finished
                [request] = d0.received
                assert isinstance(request, GenerateRequest)
                assert list(request.prompt_token_ids) == PROMPT
                assert (request.page_hashes, request.resume_token_ids) == (HASHES, ())
                assert len(HASHES) == 2
                assert p0.received == []
                assert client.stats()["gateway_prompt_hashes"] == 1
        finally:
            await d0.close()
            await p0.close()

    run_scenario(scenario)


def _refused_then_served() -> dict[str, Any]:
    """d0 (picked first: the name breaks the tie) refuses r1 as draining before any
    token; d1 serves. What the caller, the workers and the client saw."""
    seen: dict[str, Any] = {}

    async def scenario(context: zmq.asyncio.Context) -> None:
        d0 = decode_peer(context, "d0", decode_script(refuse="draining"))
        d1 = decode_peer(context, "d1", decode_script())
        try:
            async with cluster_client([d0.address, d1.address]) as client:
                await decodes_ready(client, 2)
                seen["outputs"] = await generate(client)
                seen["d0"], seen["d1"] = sent(d0), sent(d1)
                seen["stats"] = client.stats()
        finally:
            await d0.close()
            await d1.close()

    run_scenario(scenario)
    return seen


def test_a_refusal_as_draining_sends_the_request_to_another_decode_worker() -> None:
    """The request goes to d1 unchanged (no resume tokens: nothing had streamed), the
    caller gets d1's stream whole, and it counts as no migration."""
    seen = _refused_then_served()
    assert tokens_of(seen["outputs"]) == TOKENS
    assert seen["d0"] == [("r1", HASHES, ())]
    assert seen["d1"] == [("r1~1", HASHES, ())]
    assert seen["stats"]["gateway_migrations"] == 0


def test_a_request_sent_to_a_second_worker_streams_under_its_own_id() -> None:
    """Every output the caller gets carries the caller's request id, also when the
    first worker refused and the stream came from a second attempt ("r1~1")."""
    seen = _refused_then_served()
    assert [output.request_id for output in seen["outputs"]] == ["r1"] * len(TOKENS)


def test_a_request_sent_to_a_second_worker_is_still_hashed_once() -> None:
    """The prompt's pages are hashed once per request (the router's and the client's
    contract), also when a refusal sends it to another worker."""
    seen = _refused_then_served()
    assert seen["stats"]["gateway_prompt_hashes"] == 1


def test_a_stream_whose_decode_worker_dies_continues_on_another() -> None:
    """Real decode workers over fake engines: d0 streams two tokens and stops (its
    sockets close); the stream moves to d1, which is sent the tokens already streamed
    and continues after them: the caller sees one uninterrupted sequence under its own
    request id. d1 extends the gateway's hashes and hashes nothing itself."""
    seen: dict[str, Any] = {}

    async def scenario(context: zmq.asyncio.Context) -> None:
        engines = [FakeEngine(base_token=100, hold_after=2), FakeEngine(base_token=100)]
        workers = [
            DecodeWorker(
                DecodeSettings(name=f"d{i}", transfer_backend="zmq", heartbeat_interval_s=0.05),
                engine,
            )
            for i, engine in enumerate(engines)
        ]
        async with (
            serving(workers[0]) as d0,
            serving(workers[1]),
            cluster_client([w.address for w in workers]) as client,
        ):
            await decodes_ready(client, 2)
            outputs: list[RequestOutput] = []
            async for output in client.generate(PROMPT, PARAMS, "r1"):
                outputs.append(output)
                if len(outputs) == 2:
                    d0.stop.set()  # the worker goes down mid-stream
            await d0.task
            seen["outputs"] = outputs
            seen["ops"] = [engines[0].ops("r1"), engines[1].ops("r1~1")]
            seen["resume"] = engines[1].args("admit", "r1~1")[0]["resume"]
            seen["d1"] = dict(workers[1].counters)
            seen["migrations"] = client.stats()["gateway_migrations"]

    run_scenario(scenario)
    outputs = seen["outputs"]
    assert tokens_of(outputs) == [100, 101, 102, 103]
    assert {output.request_id for output in outputs} == {"r1"}
    assert [output.finished for output in outputs] == [False, False, False, True]
    assert seen["ops"] == [["admit", "abort"], ["admit"]]
    assert seen["resume"] == [100, 101]
    assert seen["migrations"] == 1
    assert seen["d1"]["resumed_requests_total"] == 1
    assert seen["d1"].get("prompt_hashes_total", 0) == 0


def test_a_stream_drained_past_its_grace_continues_on_another() -> None:
    """d0 streams two tokens, then its drain grace ends (RequestFailed "draining"
    mid-stream): the stream migrates to d1 with those tokens as resume_token_ids. d0 had
    the prompt's 4 tokens from the disk tier, d1 nothing: each output the caller sees
    reports the cached tokens of the attempt that served it, the last (its usage) d1's."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        d0 = decode_peer(context, "d0", decode_script(2, "draining", cached=4))
        d1 = decode_peer(context, "d1", decode_script())
        try:
            async with cluster_client([d0.address, d1.address]) as client:
                await decodes_ready(client, 2)
                outputs = await generate(client)
                assert tokens_of(outputs) == TOKENS
                assert sent(d0) == [("r1", HASHES, ())]
                assert sent(d1) == [("r1~1", HASHES, tuple(TOKENS[:2]))]
                assert client.stats()["gateway_migrations"] == 1
                served = [CachedTokens(disk=4)] * 2 + [CachedTokens()] * 2  # d0's, then d1's
                assert [o.cached for o in outputs] == served
        finally:
            await d0.close()
            await d1.close()

    run_scenario(scenario)


def test_a_resumed_request_refused_as_draining_goes_to_another_worker() -> None:
    """d0 streams two tokens and fails "draining" before its heartbeat has said so (a
    heartbeat lags): the resumed request may go back to d0, but d0's refusal at the
    door (nothing streamed in that attempt) must send it on to d1, not spend the
    request's migrations on d0 (max_migrations=1 here)."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        first = decode_script(stop_after=2)

        async def d0_script(peer: FakePeer, identity: bytes, msg: Message) -> None:
            if not isinstance(msg, GenerateRequest):
                return
            if len(peer.received) == 1:
                await first(peer, identity, msg)
            await peer.send_to(identity, RequestFailed(msg.request_id, "draining", "draining"))

        d0 = decode_peer(context, "d0", d0_script)
        d1 = decode_peer(context, "d1", decode_script())
        try:
            async with cluster_client([d0.address, d1.address], max_migrations=1) as client:
                await decodes_ready(client, 2)
                assert tokens_of(await generate(client)) == TOKENS
                assert [resume for _, _, resume in sent(d1)] == [tuple(TOKENS[:2])]
        finally:
            await d0.close()
            await d1.close()

    run_scenario(scenario)


@pytest.mark.parametrize(
    ("error_type", "raised"),
    [
        ("invalid_request", InvalidRequestError),
        ("capacity", CapacityError),
        ("internal", UnavailableError),
        ("timeout", UnavailableError),
    ],
)
def test_a_request_failed_becomes_the_callers_error(
    error_type: ErrorType, raised: type[Exception]
) -> None:
    """The request's own faults are 400s (InvalidRequestError, CapacityError), the rest
    503 (UnavailableError itself, not a retry): one attempt, on the one worker asked."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        d0 = decode_peer(context, "d0", decode_script(refuse=error_type))
        d1 = decode_peer(context, "d1", decode_script())
        try:
            async with cluster_client([d0.address, d1.address]) as client:
                await decodes_ready(client, 2)
                with pytest.raises(raised) as failure:
                    await generate(client)
                assert type(failure.value) is raised
                assert sent(d0) == [("r1", HASHES, ())] and sent(d1) == []
        finally:
            await d0.close()
            await d1.close()

    run_scenario(scenario)


@pytest.mark.parametrize(
    ("page_size", "namespace", "why"),
    [(8, NAMESPACE, "8 tokens"), (PAGE_SIZE, hash_namespace("other-model"), "namespace")],
    ids=["page size", "hash namespace"],
)
def test_a_decode_worker_with_other_pages_is_refused(
    page_size: int, namespace: bytes, why: str
) -> None:
    """d0's HelloAck names another page size or hash namespace: its link never comes
    up, so the request goes to d1 although d0 would win the tie."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        d0 = decode_peer(context, "d0", decode_script(), page_size, namespace)
        d1 = decode_peer(context, "d1", decode_script())
        try:
            async with cluster_client([d0.address, d1.address]) as client:
                assert client.decodes is not None
                bad = client.decodes.by_address(d0.address)
                assert bad is not None
                await until(lambda: bad.refused, "d0's HelloAck refused")
                await decodes_ready(client, 1)
                assert why in bad.refused and not bad.up
                assert tokens_of(await generate(client)) == TOKENS
                assert sent(d0) == [] and sent(d1) == [("r1", HASHES, ())]
        finally:
            await d0.close()
            await d1.close()

    run_scenario(scenario)


def test_the_gateway_learns_the_workers_identity_and_refuses_another() -> None:
    """The gateway loads no weights: it takes the namespace and model identity of the
    first decode worker (hashing no prompt before), routes by it, and refuses a decode
    worker of another identity, /debug/cache naming both."""
    mine = ModelIdentity("sha256:" + "a1" * 32, "int4", "bfloat16")
    other = ModelIdentity("sha256:" + "b2" * 32, "none", "float32")

    def peer(context: zmq.asyncio.Context, name: str, identity: ModelIdentity) -> FakePeer:
        ack = HelloAck(name, "decode", 1, model_name=MODEL, max_model_len=256,
                       page_size=PAGE_SIZE, hash_namespace=hash_namespace(identity.key),
                       model_identity=identity.key)  # fmt: skip
        return FakePeer(context, ack, decode_script())

    async def scenario(context: zmq.asyncio.Context) -> None:
        d0 = peer(context, "d0", mine)
        try:
            settings = GatewaySettings(decode_workers=[d0.address], heartbeat_interval_s=0.05)
            client = ClusterClient(settings, None, MODEL, 256, PAGE_SIZE)  # type: ignore[arg-type]
            assert client.root_namespace is None and client.identity is None
            await client.start()
            try:
                await decodes_ready(client, 1)
                assert client.root_namespace == hash_namespace(mine.key)
                assert client.identity == mine
                assert tokens_of(await generate(client)) == TOKENS
                learned = tuple(page_hashes(PROMPT, PAGE_SIZE, hash_namespace(mine.key)))
                assert sent(d0) == [("r1", learned, ())]
                # its answer to a hello of a restart arrives while up: down, up, known
                assert client.decodes is not None
                [up] = client.decodes.up()
                assert up.ack is not None
                d0.ack = dataclasses.replace(d0.ack, generation=2)  # its heartbeats say so
                client.decodes._acked(up, d0.ack)
                assert up.up and client.root_namespace == hash_namespace(mine.key)
                d1 = peer(context, "d1", other)
                try:
                    assert client.decodes is not None
                    link = client.decodes.add(d1.address)
                    await until(lambda: link.refused, "d1's HelloAck refused")
                    entry = client.worker_stats()[link.label].model_identity
                    assert entry is not None
                    assert not link.up and "model identity" in entry["refused"]
                    assert mine.short in entry["refused"] and other.short in entry["refused"]
                    card = client.worker_stats()["d0"].model_identity
                    assert card == {**mine.to_dict(), "short": mine.short}
                finally:
                    await d1.close()
            finally:
                await client.shutdown()
        finally:
            await d0.close()

    run_scenario(scenario)


def test_a_scoped_request_carries_its_scope_and_scoped_hashes_to_every_worker() -> None:
    """The prompt is hashed in its cache scope's namespace; the scope and those hashes
    (and its tenant share) go to the decode worker, and to the next one when the first
    refuses; a real decode worker passes the scope and share to its engine and hashes
    nothing itself."""
    scope = cache_scope(tenant="acme", salt="conversation-7")
    share = TenantShare("0123456789abcdef", 3, 2.0)  # and its place in the schedules
    scoped = tuple(page_hashes(PROMPT, PAGE_SIZE, scoped_namespace(NAMESPACE, scope)))
    seen: dict[str, Any] = {}

    async def scenario(context: zmq.asyncio.Context) -> None:
        d0 = decode_peer(context, "d0", decode_script(refuse="draining"))
        engine = FakeEngine(base_token=100)
        worker = DecodeWorker(
            DecodeSettings(name="d1", transfer_backend="zmq", heartbeat_interval_s=0.05), engine
        )
        try:
            async with serving(worker), cluster_client([d0.address, worker.address]) as client:
                await decodes_ready(client, 2)
                outputs = client.generate(PROMPT, PARAMS, "r1", cache_scope=scope, share=share)
                seen["tokens"] = tokens_of([output async for output in outputs])
                seen["d0"] = [(m.cache_scope, m.page_hashes, to_share(m))
                              for m in d0.of_type(GenerateRequest)]  # fmt: skip
                seen["admit"] = engine.args("admit", "r1~1")[0]
                seen["hashed"] = worker.counters.get("prompt_hashes_total", 0)
        finally:
            await d0.close()

    run_scenario(scenario)
    assert seen["tokens"] == [100, 101, 102, 103]
    assert scoped != HASHES and seen["d0"] == [(scope, scoped, share)]
    assert seen["admit"]["cache_scope"] == scope and seen["admit"]["share"] == share
    assert seen["hashed"] == 0
