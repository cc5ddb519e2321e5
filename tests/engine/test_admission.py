"""First tokens under load, counted in engine steps (never timed): a cached request that
arrives while a long decode batch and long prefills keep every step full gets its first
token at most two steps after it arrives — it waits for the step in flight once (its one
admission), then its short delta goes ahead of the long prefills' chunks. And the
scheduler's tiers: decodes first, short deltas before long chunks, chunks bounded."""

from __future__ import annotations

import asyncio

from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.kv_cache_manager import KVCacheManager
from radixserve.engine.request import Request, RequestStatus
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.scheduler import Scheduler
from tests.engine.engine_helpers import TINY, assert_no_leaks, make_engine

SYSTEM = "You are the help desk of a public library. " * 20  # ~200 tokens
LONG = SamplingParams(max_tokens=400, min_tokens=400, temperature=0.0, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def test_a_cached_request_gets_its_first_token_two_steps_after_it_arrives():
    # a small step budget, so that four long prefills in chunks of 64 fill every step
    engine = make_engine(
        TINY, kv_cache_memory_gib=0.2, max_num_batched_tokens=256, prefill_chunk_tokens=64
    )
    tok = engine.tokenizer
    cached = tok.encode(SYSTEM + "When do you open?")
    engine.generate([cached], SamplingParams(max_tokens=1))  # now cached (but its last page)
    steps: list[list[str]] = []  # request ids with an output, per step
    step = engine.step

    def counted():  # on the engine thread
        outputs = step()
        steps.append([o.request_id for o in outputs])
        return outputs

    engine.step = counted  # type: ignore[method-assign]
    front = AsyncEngine(engine)

    async def main() -> int:
        async def drain(rid: str, prompt: list[int], params: SamplingParams) -> None:
            _, out = await front.call(lambda e: e.admit(prompt, params, rid), watch=rid)
            async for _ in front.outputs(rid, out):
                pass

        decodes = [
            asyncio.create_task(drain(f"decode-{i}", tok.encode(f"Story {i}:"), LONG))
            for i in range(6)
        ]
        while len(steps) < 3:  # the decode batch is running
            await asyncio.sleep(0.01)
        prefills = [
            asyncio.create_task(drain(f"long-{i}", tok.encode(f"[{i}] " + SYSTEM * 3), GREEDY))
            for i in range(4)
        ]
        while not any(rid.startswith("decode") for rid in steps[-1]) or len(steps) < 6:
            await asyncio.sleep(0.01)
        arrival = len(steps)  # steps done when it arrives; the next one is in flight
        admission, out = await front.call(
            lambda e: e.admit(cached, GREEDY, "cached"), watch="cached"
        )
        assert admission.route == "local" and admission.cached_tokens > 0
        await out.get()
        first = next(i for i, rids in enumerate(steps, 1) if "cached" in rids)
        async for _ in front.outputs("cached", out):
            pass
        first_long = next(
            (i for i, rids in enumerate(steps, 1) if any(r.startswith("long") for r in rids)),
            None,
        )
        for task in decodes + prefills:
            task.cancel()
        await asyncio.gather(*decodes, *prefills, return_exceptions=True)
        while engine.has_unfinished():  # the aborts went through
            await asyncio.sleep(0.01)
        # the long prompts arrived first and were still computing: it went ahead of them
        assert first_long is None or first_long > first
        return first - arrival

    try:
        assert asyncio.run(main()) <= 2
    finally:
        front.close()
    assert_no_leaks(engine)


def test_tiers_decodes_then_short_deltas_then_chunks():
    def request(rid: str, tokens: int, computed: int = 0) -> Request:
        # the scheduler reads token counts only: no detokenizer is needed
        req = Request(rid, list(range(tokens)), GREEDY, detokenizer=None)  # type: ignore[arg-type]
        req.num_computed = computed
        return req

    s = Scheduler(KVCacheManager(4096, 16), max_num_batched_tokens=200, max_num_seqs=16,
                  prefill_chunk_tokens=64)  # fmt: skip
    for rid, n, done in (("dec", 10, 9), ("long-run", 500, 64)):
        req = request(rid, n, done)
        req.status = RequestStatus.RUNNING
        req.page_ids = list(range(-(-done // 16)))
        s.running.append(req)
    s.add(request("long-wait", 400))
    s.add(request("short", 30))
    batch = s.schedule()
    assert batch is not None
    got = dict(zip((r.request_id for r in batch.requests), batch.num_new_tokens))
    # the decode first, the short one ahead of the older long waiting one, every long
    # prompt at most one chunk, and the step within its budget
    assert list(got) == ["dec", "short", "long-run", "long-wait"]
    assert got == {"dec": 1, "short": 30, "long-run": 64, "long-wait": 64}
    assert sum(got.values()) <= 200
