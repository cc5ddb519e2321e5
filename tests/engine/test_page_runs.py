"""Requests that decode together keep their pages in runs (the allocator's reservations),
and every reservation is returned on finish, abort and preemption."""

from __future__ import annotations

from radixserve.engine.sampling_params import SamplingParams
from radixserve.kernels.cpu.decode_attention import block_pages
from tests.engine.engine_helpers import TINY, assert_no_leaks, make_engine

PAGE = 4


def _runs(pages: list[int]) -> int:
    """How many runs of consecutive ids `pages` is made of."""
    return 1 + sum(1 for a, b in zip(pages, pages[1:]) if b != a + 1)


def test_concurrent_decodes_keep_their_pages_in_runs_and_return_the_rest() -> None:
    """Four requests prefill and then decode a page at a time in the same steps; each one's
    pages stay one run (its prompt's pages, then its decode pages right after them), and
    when one finishes early and another is aborted nothing stays reserved."""
    engine = make_engine(TINY, page_size=PAGE, kv_cache_memory_gib=0.05)
    assert block_pages(PAGE) * PAGE == 256  # a request's run covers prompt + max_tokens here
    prompts = [f"Story number {i} about the sea, the wind and a small boat." for i in range(4)]
    long = SamplingParams(max_tokens=120, min_tokens=120, temperature=0.0)
    short = SamplingParams(max_tokens=9, min_tokens=9, temperature=0.0)
    ids = [engine.add_request(p, short if i == 3 else long) for i, p in enumerate(prompts)]
    for _ in range(60):  # every request decoding, page after page, side by side
        engine.step()
    running = {r.request_id: r for r in engine.scheduler.running}
    assert ids[3] not in running  # finished: its reservation went back with its pages
    for rid in ids[:3]:
        req = running[rid]
        assert len(req.page_ids) * PAGE >= req.num_computed > 60
        assert _runs(req.page_ids) == 1, req.page_ids
    assert engine.allocator.num_reserved > 0
    engine.abort(ids[0])
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(engine)  # no page held, none reserved
