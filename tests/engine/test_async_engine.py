"""Async streaming: deltas add up to the sync result; leaving early aborts and frees pages."""

from __future__ import annotations

import asyncio
import threading

import pytest

from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import InvalidRequestError
from tests.engine.engine_helpers import TINY, assert_no_leaks, make_engine

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


@pytest.fixture(scope="module")
def engines():
    engine = make_engine(TINY, kv_cache_memory_gib=0.1)
    reference = make_engine(TINY, kv_cache_memory_gib=0.1, prefix_cache=False)
    front = AsyncEngine(engine)
    yield front, reference
    front.close()


async def _collect(front, prompt, params=GREEDY):
    outs = [out async for out in front.stream(prompt, params)]
    return "".join(o.new_text for o in outs), [t for o in outs for t in o.new_token_ids], outs[-1]


def test_concurrent_streams_match_sync_generate(engines):
    front, reference = engines
    prompts = ["Once upon a time", "The three primary colours are", "A haiku about rain:"]

    async def main():
        return await asyncio.gather(*(_collect(front, p) for p in prompts))

    streamed = asyncio.run(main())
    expected = reference.generate(prompts, GREEDY)
    for (text, ids, last), ref in zip(streamed, expected):
        assert ids == ref.token_ids and text == ref.text
        assert last.finished and last.finish_reason == ref.finish_reason


def test_leaving_a_stream_early_aborts_the_request(engines):
    front, _ = engines

    async def main():
        async for out in front.stream("Count to one hundred:", SamplingParams(max_tokens=200)):
            if out.completion_tokens >= 3:
                break
        for _ in range(200):  # the engine thread processes the abort
            if front.engine.cache_stats()["live_requests"] == 0:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert_no_leaks(front.engine)


def test_bad_request_raises_before_streaming(engines):
    front, _ = engines

    async def main():
        async for _ in front.stream(""):
            pass

    with pytest.raises(InvalidRequestError, match="empty"):
        asyncio.run(main())


def test_stats_include_what_a_call_changed_once_it_returns():
    """The counters read right after a call include the call's effect (an operator's
    clear of a failed-closed audit shows at once). No step runs between the call and
    the read here: the engine thread is held before the call and right after it."""
    engine = make_engine(TINY, kv_cache_memory_gib=0.1, audit_sample_rate=1.0,
                         audit_fail_closed=True)  # fmt: skip
    front = AsyncEngine(engine)
    first, second = threading.Event(), threading.Event()

    def fail_closed(e) -> None:
        e.kv.serve_from_cache = False

    async def main() -> int:
        front.submit(lambda e: first.wait(10))  # holds the engine thread
        call = asyncio.ensure_future(front.call(fail_closed))
        await asyncio.sleep(0)  # the call is queued
        front.submit(lambda e: second.wait(10))  # handled right after it, before any step
        first.set()
        await call
        return front.stats().cache["audit_fail_closed"]

    try:
        assert front.stats().cache["audit_fail_closed"] == 0
        assert asyncio.run(main()) == 1
    finally:
        first.set()
        second.set()
        front.close()


@pytest.mark.parametrize("refuse_at", [None, 5], ids=["sink takes all", "sink refuses the 6th"])
def test_a_sink_gets_the_outputs_but_the_last_on_the_engine_thread_the_queue_the_rest(
    engines, refuse_at
):
    """`admit(..., sink=)`: the sink gets each output but the last, on the engine thread,
    until it refuses one; that one and every later one come on the queue. Together they
    are the stream, in order, with the tokens of a run without a sink."""
    front, reference = engines
    prompt_ids = front.engine.tokenizer.encode("The three primary colours are")
    taken: list[tuple[list[int], str]] = []

    def sink(output) -> bool:
        if len(taken) == refuse_at:
            return False
        taken.append((list(output.new_token_ids), threading.current_thread().name))
        return True

    async def main():
        rid = f"sink-{refuse_at}"
        _, out = await front.admit(rid, prompt_ids, GREEDY, sink=sink)
        return [o async for o in front.outputs(rid, out)]

    queued = asyncio.run(main())
    expected = reference.generate([prompt_ids], GREEDY)[0].token_ids
    assert {thread for _, thread in taken} == {"radixserve-engine"}
    assert [t for ids, _ in taken for t in ids] + [t for o in queued for t in o.new_token_ids] == (
        expected
    )
    assert len(queued) == 1 if refuse_at is None else len(taken) == refuse_at
    assert queued[-1].finished and not any(o.finished for o in queued[:-1])
