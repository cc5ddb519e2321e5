"""The prefill worker in-process, over a fake engine (`tests.fake_engine`), driven by a
test socket speaking the protocol as a decode worker: it lends the prompt's pages under
a lease (readable by a real ZMQ transfer agent) and names exactly those past the decode
side's cached prefix; TransferDone, a decode worker that goes silent, or an Abort while
it computes releases what it holds; draining, it refuses new prompts and leaves once
its lent pages are read."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
import zmq.asyncio

from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.wire import to_spec
from radixserve.protocol import Abort, KVReady, PrefillRequest, RequestFailed, TransferDone
from radixserve.protocol.cached_tokens import CachedTokens
from radixserve.protocol.lora_messages import LoraAdapterInfo
from radixserve.services.prefill.settings import PrefillSettings
from radixserve.services.prefill.worker import PrefillWorker
from radixserve.transfer import KVTransferAgent, PoolCompat, create_agent
from tests.fake_engine import MODEL, PAGE_SIZE, FakeEngine, PeerSocket, run_scenario, serving, until

PROMPT = tuple(range(1, 13))  # 12 tokens, 3 pages
SAMPLING = to_spec(SamplingParams(max_tokens=4, temperature=0.0))


def prefill_request(rid: str, num_cached_tokens: int = 0) -> PrefillRequest:
    num_pages = len(PROMPT) // PAGE_SIZE - num_cached_tokens // PAGE_SIZE
    return PrefillRequest(rid, PROMPT, tuple(range(num_pages)), SAMPLING, num_cached_tokens)


@contextlib.asynccontextmanager
async def prefill_worker(
    context: zmq.asyncio.Context, engine: FakeEngine, **settings: Any
) -> AsyncIterator[tuple[PrefillWorker, asyncio.Task, PeerSocket]]:
    """A prefill worker, its task, and a decode worker's socket to it past the handshake."""
    worker = PrefillWorker(
        PrefillSettings(name="p0", transfer_backend="zmq", heartbeat_interval_s=0.05, **settings),
        engine,
    )
    async with serving(worker) as running:
        decode = PeerSocket(context, worker.address)
        try:
            ack = await decode.hello("decode-test", "decode")
            assert (ack.name, ack.role, ack.page_size) == ("p0", "prefill", PAGE_SIZE)
            yield worker, running.task, decode
        finally:
            decode.close()


@pytest.mark.parametrize("num_cached_tokens", [0, PAGE_SIZE])
def test_pages_are_lent_under_a_lease_until_transfer_done(num_cached_tokens: int) -> None:
    """KVReady names the leased pages past the decode side's cached prefix, the first
    token and the cached count; a real agent reads them (page j holds j + 1), lent to it
    by name: another reader is refused them; the lease holds until TransferDone, which
    releases it exactly once, and with it the grant (a read after it is refused)."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine(first_token=7)
        async with prefill_worker(context, engine) as (worker, _, decode):
            await decode.send(prefill_request("r1", num_cached_tokens))
            ready = await decode.recv(KVReady)
            [leased] = engine.leases.values()
            skip = num_cached_tokens // PAGE_SIZE
            assert ready.request_id == "r1" and ready.first_token_ids == (7,)
            assert ready.src_page_ids == tuple(leased[skip:])
            assert (ready.cached, engine.stats().leases) == (CachedTokens(), 1)
            # how long the pages stay lent from now: the worker's lease_s, less its work
            assert (
                ready.lease_ms is not None and 0 < ready.lease_ms <= worker.settings.lease_s * 1000
            )

            kv = torch.zeros(1, 2, 4, PAGE_SIZE, 1, 2)  # the reader's pool (L, 2, P, S, H, D)
            reader = create_agent("zmq", "decode-test", kv, PoolCompat.of(kv, MODEL))
            other = create_agent("zmq", "decode-other", kv.clone(), PoolCompat.of(kv, MODEL))
            src, dst = list(ready.src_page_ids), list(range(len(ready.src_page_ids)))

            async def read(agent: KVTransferAgent) -> str:
                return await agent.wait_async(agent.read_pages("p0", src, dst, timeout_s=5))

            try:
                ack = decode.ack
                assert ack is not None and ack.transfer_metadata
                for agent in (reader, other):
                    agent.add_peer("p0", ack.generation, ack.transfer_metadata)
                assert await read(reader) == "done"
                assert await read(other) == "failed"  # not lent to it
                for j, page in enumerate(dst):
                    want = torch.full_like(kv[:, :, page], skip + j + 1)
                    assert torch.equal(kv[:, :, page], want)

                assert engine.ops("r1") == ["admit"]  # read, but not released yet
                await decode.send(TransferDone("r1"))
                await until(lambda: engine.stats().leases == 0, "TransferDone to release the lease")
                assert await read(reader) == "failed"  # returned: no longer lent
                assert worker.agent is not None and worker.agent.refused_reads == 2
            finally:
                reader.close()
                other.close()
            assert engine.ops("r1") == ["admit", "release_lease"]
            assert engine.pages_in_use() == 0
            assert worker.counters["prefill_requests_total"] == 1
            assert worker.counters["prefill_computed_tokens_total"] == len(PROMPT)

    run_scenario(scenario)


def test_a_decode_worker_that_goes_silent_loses_its_leases() -> None:
    """A decode worker that never reads (it died: no TransferDone, no heartbeat) is
    dropped after ``peer_timeout_s`` and the lease it held is released then."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine()
        async with prefill_worker(context, engine, peer_timeout_s=0.3) as (worker, _, decode):
            await decode.send(prefill_request("r1"))
            await decode.recv(KVReady)
            assert engine.ops("r1") == ["admit"] and engine.stats().leases == 1
            decode.close()  # it dies: silent from now on
            await until(lambda: engine.stats().leases == 0, "the silent peer's lease released")
            assert engine.ops("r1") == ["admit", "release_lease"]
            assert worker.peers == {}

    run_scenario(scenario)


def test_an_abort_while_computing_cancels_and_releases() -> None:
    """An Abort before the prompt is computed cancels the request: the engine request is
    aborted (the output iterator left early) and its lease released; no KVReady."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine(answer_prefills=False)  # computes until aborted
        async with prefill_worker(context, engine) as (worker, _, decode):
            await decode.send(prefill_request("r1"))
            await until(lambda: engine.ops("r1") == ["admit"], "the prompt admitted")
            assert worker.queued_tokens() == len(PROMPT)
            await decode.send(Abort("r1"))
            await until(lambda: not worker.tasks, "the request's task to end")
            assert engine.ops("r1") == ["admit", "abort", "release_lease"]
            assert worker.queued_tokens() == 0
            assert worker.counters["prefill_requests_total"] == 0

    run_scenario(scenario)


def test_a_draining_worker_refuses_new_prompts_and_leaves_once_its_pages_are_read() -> None:
    """While pages are lent, a drain keeps the worker up but refuses a new
    PrefillRequest with "draining" (never admitted); TransferDone lets the drain end
    and the worker stop by itself."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine()
        async with prefill_worker(context, engine) as (worker, task, decode):
            await decode.send(prefill_request("r1"))
            await decode.recv(KVReady)
            worker.begin_drain()
            await decode.send(prefill_request("r2"))
            refused = await decode.recv(RequestFailed)
            assert (refused.request_id, refused.error_type) == ("r2", "draining")
            assert engine.ops("r2") == []
            assert worker.counters["refused_draining_total"] == 1
            assert not task.done() and worker.busy()  # waiting for r1's reader
            await decode.send(TransferDone("r1"))
            await asyncio.wait_for(asyncio.shield(task), 5)  # the drain ends the service
            assert engine.ops("r1") == ["admit", "release_lease"]
            assert engine.calls[-1].op == "close"

    run_scenario(scenario)


def test_a_lease_that_runs_out_takes_its_grant_with_it() -> None:
    """Pages lent to a decode worker that never says TransferDone stop being readable by
    it when the lease runs out (the grant ends no later than the engine's lease)."""

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine()
        async with prefill_worker(context, engine, lease_s=0.5) as (worker, _, decode):
            await decode.send(prefill_request("r1"))
            ready = await decode.recv(KVReady)
            assert worker.agent is not None
            grants, pages = worker.agent.local.grants, list(ready.src_page_ids)
            assert grants.enforced and grants.allows("decode-test", pages)
            await until(lambda: not grants.num_pages(), "the grant to end")
            assert not grants.allows("decode-test", pages)
            assert engine.ops("r1") == ["admit"]  # the engine's lease, its own to end

    run_scenario(scenario)


def test_a_prompt_of_a_lora_adapter_it_serves_otherwise_is_refused_uncomputed() -> None:
    """A prefill worker computes a LoRA adapter's prompt only with the content the decode
    side names (``adapter_fingerprint``): an adapter it does not serve, or serves with
    other content, is answered RequestFailed "internal" (the decode worker recomputes it;
    never the request's own fault) and nothing is admitted; its own content's is computed
    and `KVReady` states the fingerprint."""
    mine, other = "sha256:" + "1" * 64, "sha256:" + "2" * 64

    async def scenario(context: zmq.asyncio.Context) -> None:
        engine = FakeEngine()
        async with prefill_worker(context, engine) as (worker, _, decode):
            worker.loras.adopt([LoraAdapterInfo("a", mine, b"n" * 32)])
            for rid, name, fingerprint in (("r1", "a", other), ("r2", "b", other)):
                request = dataclasses.replace(prefill_request(rid), adapter=name,
                                              adapter_fingerprint=fingerprint)  # fmt: skip
                await decode.send(request)
                failed = await decode.recv(RequestFailed)
                assert (failed.request_id, failed.error_type) == (rid, "internal")
                assert repr(other) in failed.message and engine.ops(rid) == []
            ok = dataclasses.replace(prefill_request("r3"), adapter="a", adapter_fingerprint=mine)
            await decode.send(ok)
            ready = await decode.recv(KVReady)
            assert (ready.request_id, ready.adapter_fingerprint) == ("r3", mine)
            assert engine.args("admit", "r3")[0]["adapter"] == "a"
            await decode.send(TransferDone("r3"))

    run_scenario(scenario)
