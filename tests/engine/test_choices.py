"""n choices: the prompt is computed once, the choices fork after it (sharing its pages,
the partial last page copied), each reproducible from its seed, and greedy choices equal
the n = 1 output exactly."""

from __future__ import annotations

import pytest

from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import assert_no_leaks

PROMPT = "Write one sentence about the sea:"


@pytest.mark.slow
def test_seeded_choices_are_distinct_reproducible_and_share_the_prompt(tiny_on):
    engine = tiny_on
    prompt = engine.tokenize(PROMPT * 3)  # not page aligned: the tail page is copied
    assert len(prompt) % engine.page_size
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.8, seed=1234, n=4)
    first = engine.generate([prompt], params)
    again = engine.generate([prompt], params)
    assert [r.index for r in first] == [0, 1, 2, 3]
    texts = [r.token_ids for r in first]
    assert len({tuple(t) for t in texts}) == 4
    assert texts == [r.token_ids for r in again]
    assert sum(r.computed_prompt_tokens for r in first) == len(prompt) - first[0].cached_tokens
    solo = engine.generate([prompt], SamplingParams(max_tokens=12, min_tokens=12,
                                                    temperature=0.8, seed=1234))  # fmt: skip
    assert solo[0].token_ids == texts[0]  # choice 0 of n draws as n = 1 does
    assert_no_leaks(engine)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [0, 5])
def test_greedy_choices_equal_the_single_output(tiny_off, extra):
    engine = tiny_off  # no cache: the copied page alone must carry the prompt's tail
    prompt = engine.tokenize("The capital of France is")
    prompt = (prompt * 8)[: 2 * engine.page_size + extra]  # page aligned and not
    single = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0]
    many = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, n=3))
    assert [r.token_ids for r in many] == [single.token_ids] * 3
    assert [r.computed_prompt_tokens for r in many] == [len(prompt), 0, 0]
    assert_no_leaks(engine)


@pytest.mark.slow
def test_abort_ends_every_choice(tiny_on):
    engine = tiny_on
    rid = engine.add_request("Count to fifty:", SamplingParams(max_tokens=50, n=3, seed=1))
    for _ in range(3):
        engine.step()
    out = engine.abort(rid)
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.abort(rid) is None
    assert_no_leaks(engine)
