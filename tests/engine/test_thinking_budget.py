"""The thinking-token budget (`SamplingParams.thinking_token_budget`): once a request has
generated its budget inside its reasoning, the engine forces the end marker's ids and the
model goes on from there. The tiny random-init model with greedy decoding gives a fixed
reply; "reasoning" is whatever the markers say (a start id taken from that reply, an end
id it never writes), so the position of the forced end is exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve.engine.engine import Engine
from radixserve.engine.sampler import Sampler
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.thinking_budget import ThinkingBudget
from radixserve.errors import InvalidRequestError
from tests.engine.engine_helpers import assert_no_leaks

PROMPT = "Here is a list of fruits: apple, banana,"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _run(engine: Engine, jobs: list[tuple[str, SamplingParams]]) -> list[list[list[int]]]:
    """Every job in one continuous batch: each one's choices' tokens, in index order."""
    ids = [engine.add_request(prompt, params) for prompt, params in jobs]
    tokens: dict[str, dict[int, list[int]]] = {i: {} for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].setdefault(out.index, []).extend(out.new_token_ids)
    return [[tokens[i][k] for k in sorted(tokens[i])] for i in ids]


def _free(engine: Engine, params: SamplingParams = GREEDY) -> list[int]:
    [[free]] = _run(engine, [(PROMPT, params)])
    return free


def _end_id(engine: Engine, free: list[int]) -> int:
    """A token the free reply never writes (nor is EOS): the end marker."""
    return next(t for t in range(1000, 2000)
                if t not in free and t not in engine.config.eos_token_ids)  # fmt: skip


def _budget(budget: int, end: tuple[int, ...], **fields) -> SamplingParams:
    fields.setdefault("thinking_open", True)
    return dataclasses.replace(GREEDY, thinking_token_budget=budget, thinking_end_ids=end,
                               **fields)  # fmt: skip


def test_the_end_marker_comes_at_the_budget(tiny_on):
    free = _free(tiny_on)
    end = _end_id(tiny_on, free)
    for budget in (0, 1, 4):
        [[capped]] = _run(tiny_on, [(PROMPT, _budget(budget, (end,)))])
        assert capped[:budget] == free[:budget]
        assert capped[budget] == end
        assert end not in capped[budget + 1 :]  # one end, then the model goes on
    # a budget the reply cannot reach, or reasoning it closes itself, changes nothing
    [[roomy]] = _run(tiny_on, [(PROMPT, _budget(len(free), (end,)))])
    [[closed]] = _run(tiny_on, [(PROMPT, _budget(3, (free[2],)))])
    assert roomy == free == closed
    assert_no_leaks(tiny_on)


def test_reasoning_opened_by_the_reply_and_a_multi_token_marker(tiny_on):
    free = _free(tiny_on)
    end = _end_id(tiny_on, free)
    start = free[1]
    opened = free.index(start) + 1  # the first reasoning token's position
    params = _budget(3, (end, end + 1), thinking_open=False, thinking_start_ids=(start,))
    [[capped]] = _run(tiny_on, [(PROMPT, params)])
    assert capped[: opened + 3] == free[: opened + 3]
    assert capped[opened + 3 : opened + 5] == [end, end + 1]
    assert_no_leaks(tiny_on)


def test_forcing_leaves_the_other_rows_of_the_batch_alone(tiny_on):
    """Greedy and seeded rows beside budgeted ones (and the choices of an n=2 request,
    each with its own budget) give the tokens they give alone."""
    free = _free(tiny_on)
    end = _end_id(tiny_on, free)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    seeded_alone = _free(tiny_on, seeded)
    two = dataclasses.replace(seeded, n=2, thinking_token_budget=5, thinking_end_ids=(end,),
                              thinking_open=True)  # fmt: skip
    results = _run(tiny_on, [(PROMPT, GREEDY), (PROMPT, _budget(2, (end,))), (PROMPT, seeded),
                             (PROMPT, two)])  # fmt: skip
    assert results[0] == [free] and results[2] == [seeded_alone]
    assert results[1][0][:3] == [*free[:2], end]
    for choice in results[3]:
        assert choice[5] == end
    assert results[3][0][:5] == seeded_alone[:5]  # choice 0 draws as the lone seeded one
    assert_no_leaks(tiny_on)


def test_a_resumed_request_counts_the_tokens_it_resumes_after(tiny_on):
    free = _free(tiny_on)
    end = _end_id(tiny_on, free)
    params = _budget(4, (end,))
    [[whole]] = _run(tiny_on, [(PROMPT, params)])
    tiny_on.admit(PROMPT, params, request_id="resumed", resume=whole[:3])
    rest: list[int] = []
    while tiny_on.has_unfinished():
        for out in tiny_on.step():
            rest.extend(out.new_token_ids)
    assert whole[:3] + rest == whole and whole[4] == end
    assert_no_leaks(tiny_on)


def test_the_sampler_masks_forced_rows_only():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0)]  # fmt: skip
    sampler = Sampler()

    def sample(forced=None) -> list[int]:
        torch.manual_seed(1)
        return sampler(logits, params, [None] * 3, [0] * 3, (), forced=forced).tolist()

    free = sample()
    for row in range(3):
        token = (free[row] + 1) % 50
        forced = sample(([row], [token]))
        assert forced[row] == token
        assert [t for i, t in enumerate(forced) if i != row] == [
            t for i, t in enumerate(free) if i != row]  # fmt: skip


def test_the_tracker_follows_the_markers():
    budget = ThinkingBudget(2, start_ids=(1, 2), end_ids=(8, 9), inside=False)
    for token in (5, 1, 2):  # the start marker opens the reasoning
        assert budget.forced() is None
        budget.add(token)
    assert budget.inside
    budget.add(6)
    budget.add(8)  # the end marker's first id, written by the model: the second is forced
    assert budget.forced() == 9
    budget.add(9)
    assert not budget.inside and budget.forced() is None
    budget.add(1)
    budget.add(2)  # a second segment: the budget is spent already
    assert budget.forced() == 8


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"thinking_token_budget": 4}, "thinking_token_budget"),  # no end marker
        ({"thinking_token_budget": 4, "thinking_end_ids": (3,)}, "thinking_token_budget"),
        ({"thinking_token_budget": -1, "thinking_end_ids": (3,), "thinking_open": True},
         "thinking_token_budget"),
        ({"thinking_token_budget": 4, "thinking_end_ids": (3,), "thinking_open": True,
          "guide_kind": "regex", "guide": "a+"}, "thinking_token_budget"),
        ({"thinking_end_ids": tuple(range(17))}, "thinking_end_ids"),
        ({"thinking_open": 1}, "thinking_open"),
    ],
)  # fmt: skip
def test_bad_budgets_are_refused_by_name(fields, param):
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**fields)
    assert refused.value.param == param


def test_marker_ids_outside_the_vocabulary_are_refused(tiny_on):
    vocab = tiny_on.config.vocab_size
    with pytest.raises(InvalidRequestError) as refused:
        tiny_on.add_request(PROMPT, _budget(2, (vocab,)))
    assert refused.value.param == "thinking_end_ids"
    assert_no_leaks(tiny_on)
