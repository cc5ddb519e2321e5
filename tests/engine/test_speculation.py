"""Speculative decoding (`radixserve.engine.speculation`): drafts from the request's own
tokens and from the draft index, verified exactly. With speculation on, every request
gets the tokens (and log-probabilities) decoding one by one gives: greedy, seeded
sampling, penalties, stop strings, ``n`` choices, a thinking budget; drafts are really
verified (the counters move); no draft crosses a cache namespace; no page leaks."""

from __future__ import annotations

import random

import pytest

from radixserve.engine.draft_index import DraftIndex, evidence_class
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.speculation import NgramPlaces, prompt_lookup
from tests.engine.engine_helpers import TINY, make_engine

CODE = """def add(a, b):
    return a + b


def subtract(a, b):
    return a - b


def multiply(a, b):
    return a * b
"""


def test_prompt_lookup_takes_the_latest_earlier_occurrence_of_the_longest_ngram():
    assert prompt_lookup([1, 2, 3, 4, 5, 6, 1, 2, 3], 3) == [4, 5, 6]
    assert prompt_lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # the latest
    assert prompt_lookup([5, 1, 2, 8, 7, 1, 2, 9, 4, 7, 1, 2], 1) == [9]  # 3 tokens beat 2
    assert prompt_lookup([1, 2, 3, 4], 4) == []  # nothing repeats
    places = NgramPlaces()  # kept up to date as the tokens grow
    assert prompt_lookup([1, 2, 3, 1], 2, places) == []
    assert prompt_lookup([1, 2, 3, 1, 2], 2, places) == [3, 1]


def test_the_draft_index_keeps_namespaces_apart_and_its_bound():
    index = DraftIndex(max_tokens=12)
    index.add(b"a", [5, 6, 7, 8, 9, 10])
    assert index.lookup(b"a", [1, 6, 7], 3)[0] == [8, 9, 10]
    assert index.lookup(b"b", [1, 6, 7], 3) == ([], [])  # another tenant's text: never
    index.add(b"b", [6, 7, 1, 2, 3, 4, 5, 6])  # 14 tokens > 12: a's sequence goes
    assert index.lookup(b"a", [6, 7], 3) == ([], [])
    assert index.lookup(b"b", [6, 7], 3)[0] == [1, 2, 3]
    assert index.num_tokens == 8


def test_the_draft_index_takes_back_exactly_what_it_counted():
    """Sequences over few tokens (n-grams with one continuation, then several, then one
    again as texts go): once the bound drops the early ones, the index is the one the
    kept sequences alone make."""
    rng = random.Random(0)
    index = DraftIndex(max_tokens=400)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(3, 40))] for _ in range(200)]
    for seq in seqs:
        index.add(b"a", seq)
    fresh, kept = DraftIndex(max_tokens=400), 0
    for seq in reversed(seqs):  # the newest sequences, as many as the bound keeps
        if kept + len(seq) > index.num_tokens:
            break
        kept += len(seq)
    for seq in seqs[len(seqs) - len(index._spaces[b"a"].sequences) :]:
        fresh.add(b"a", seq)
    assert kept == index.num_tokens == fresh.num_tokens
    assert index._spaces[b"a"].nexts == fresh._spaces[b"a"].nexts


def test_a_radix_draft_is_the_most_frequent_continuation():
    index = DraftIndex()
    for seq in ([1, 2, 3, 4, 5, 7], [9, 2, 3, 4, 6, 7], [8, 2, 3, 4, 6, 7], [5, 3, 4, 5, 0]):
        index.add(b"a", seq)
    # after (2, 3, 4): 6 twice, 5 once; after (2, 3, 4, 6): 7 always; then (6, 7) ends
    # the text. The evidence: 3 tokens that parted, then 4 that agreed
    assert index.lookup(b"a", [0, 2, 3, 4], 5) == ([6, 7], [evidence_class(3, False),
                                                            evidence_class(4, True)])  # fmt: skip
    # after (3, 4) alone: 5 twice and 6 twice; the tie goes to the one seen last (5)
    assert index.lookup(b"a", [0, 3, 4], 1)[0] == [5]


def test_step_times_are_measured_per_row_count_and_never_fall_with_more_rows():
    from radixserve.engine.speculation import StepCost

    cost = StepCost()
    assert cost.seconds(4) is None  # nothing timed: no speculation
    for rows, ms in [(1, 10), (3, 20), (5, 30), (9, 50), (1, 10), (16, 85)]:
        cost.observe(rows, ms / 1000)  # 5 ms a step + 5 ms a row
    times = cost.seconds(9)
    assert len(times) == 9
    assert times[0] == pytest.approx(0.010) and times[2] == pytest.approx(0.020)  # ran
    assert times[1] == pytest.approx(0.015, abs=0.001)  # never ran: the fitted line's
    cost.observe(2, 0.0101)  # a second row next to free (one read of the weights)
    assert cost.seconds(3)[1] == pytest.approx(0.0101)
    cost.observe(4, 0.012)  # a fast outlier: not cheaper than three rows
    assert cost.seconds(4)[3] == pytest.approx(0.020)
    cost.observe(2, 0.5)  # a slow outlier (it keeps drafts from two rows away) ...
    assert cost.seconds(2)[1] > 0.1
    for _ in range(cost.FRESH_STEPS):
        cost.observe(1, 0.010)
    assert cost.seconds(2)[1] < 0.02  # ... only until it is forgotten: the line's again


def _rows_cost(a: float, b: float):
    """`StepCost.seconds` pinned to ``a + b`` x rows."""
    return lambda most: [a + b * rows for rows in range(1, most + 1)]


def test_how_far_a_step_drafts_follows_acceptance_and_the_step_times():
    from radixserve.engine.speculation import Speculator

    spec = Speculator("both", max_draft_tokens=8, max_batch=64)
    spec.cost.seconds = _rows_cost(9.0, 1.0)  # a row a tenth of a one-row step

    def lengths(*drafts: tuple[str, int]) -> list[int]:
        """How far a step of these prompt-lookup drafts (request id, tokens) verifies."""
        return spec.draft_lengths([spec.worth(r, "prompt", n) for r, n in drafts], len(drafts))

    # the prior p = 0.8: (1 + 0.8 + ... + 0.8^k) / (10 + k) is largest at k = 6
    assert lengths(("new", 8)) == [6]
    assert lengths(("new", 3)) == [3]  # all it has
    assert spec.draft_lengths([], 1) == []
    spec.cost.seconds = _rows_cost(0.0, 1.0)  # all of a step is its rows: no draft pays
    assert lengths(("new", 8)) == [0]
    req = type("R", (), {"request_id": "r", "draft_method": "prompt"})()
    for _ in range(10):
        spec.verified(req, drafted=4, accepted=0, emitted=1)  # every draft missed
    spec.cost.seconds = _rows_cost(9.0, 1.0)
    assert lengths(("r", 8)) == [0]
    # a second row next to free (a CPU decode step): even a long shot is worth it
    spec.cost.seconds = lambda most: [10.0, 10.05, *[12.0 + r for r in range(3, most + 1)]][:most]
    assert lengths(("r", 8)) == [1]
    for _ in range(10):
        spec.verified(req, drafted=4, accepted=4, emitted=5)  # every draft kept
    spec.cost.seconds = _rows_cost(9.0, 1.0)
    assert lengths(("r", 8)) == [8]
    # one step, two requests: the one whose drafts are kept drafts further
    both = lengths(("r", 8), ("new", 8))
    assert both[0] > both[1] > 0, both


def test_index_drafts_run_long_where_the_texts_agree_and_stop_where_they_part():
    """A draft-index token's worth is its evidence's record: the texts' agreed
    continuation (six tokens every text went on from alike) is drafted far once it is
    kept; after three tokens the texts continued differently, not at all once it misses."""
    from types import SimpleNamespace

    from radixserve.engine.speculation import Speculator

    spec = Speculator("radix", max_draft_tokens=8, max_batch=64)
    spec.cost.seconds = _rows_cost(9.0, 1.0)
    agreed = list(range(100, 130))
    for seq in (agreed, agreed, [7, 8, 9, 1], [7, 8, 9, 2]):
        spec.index.add(None, seq)

    def draft(tokens: list[int]):
        req = SimpleNamespace(request_id="r", namespace=None, guide=None, num_pending=1,
                              params=SamplingParams(max_tokens=64), output_ids=[],
                              token_ids=tokens, num_tokens=len(tokens), draft=[],
                              draft_method="")  # fmt: skip
        spec.propose([req], 1 << 20)
        return req

    first = draft(agreed[:10])  # the prior, 0.8 a token: a draft of some tokens
    assert first.draft == agreed[10 : 10 + len(first.draft)] and 0 < len(first.draft) < 8
    for _ in range(20):  # the agreed continuation is always kept
        r = draft(agreed[:10])
        spec.verified(r, len(r.draft), len(r.draft), len(r.draft) + 1)
    assert draft(agreed[:10]).draft == agreed[10:18]
    parted = draft([5, 7, 8, 9])
    assert parted.draft == [2]  # 1 and 2 once each after (7, 8, 9): the one seen last
    for _ in range(20):  # where the texts part, the draft always misses
        r = draft([5, 7, 8, 9])
        spec.verified(r, len(r.draft), 0, 1)
    assert draft([5, 7, 8, 9]).draft == []
    assert draft(agreed[:10]).draft == agreed[10:18]  # the agreed text's record is its own


def _pin_cost(engine):
    """The step times fixed (a row a tenth of a one-row step; the measured ones move with
    the machine's load): how many tokens are drafted is then the same every run; what is
    kept never depends on it."""
    engine.speculator.cost.seconds = _rows_cost(9.0, 1.0)
    return engine


def _engines(model: str, method: str, **kw):
    off = make_engine(model, kv_cache_memory_gib=0.1, **kw)
    on = make_engine(model, kv_cache_memory_gib=0.1, speculative_method=method,
                     speculative_max_draft_tokens=6, **kw)  # fmt: skip
    return off, _pin_cost(on)


def _check_no_leak(engine) -> None:
    engine.check_integrity()
    assert not engine.has_unfinished()
    stats = engine.kv.stats()  # at rest every page is free or the cache's, unlocked
    assert stats["page_refs_outside_cache"] == 0, stats
    assert stats["pages_reserved"] == 0 and stats.get("cache_locks", 0) == 0, stats


@pytest.fixture(scope="module")
def smol():
    return _engines("default", "both")


def _copy_prompts(engine) -> list[list[int]]:
    ask = [
        f"Repeat this code exactly:\n\n{CODE}",
        f"Rename add to plus and return the whole file:\n\n{CODE}",
        "Write the numbers from one to twenty in words, separated by commas.",
    ]
    return [engine.tokenizer.encode_chat([{"role": "user", "content": a}]) for a in ask]


def test_greedy_tokens_are_the_same_with_drafts_verified(smol):
    off, on = smol
    prompts = _copy_prompts(off)
    params = SamplingParams(max_tokens=96, temperature=0.0)
    expected = off.generate(prompts, params)
    for round_ in range(2):  # the second round also drafts from the first's text
        got = on.generate(prompts, params)
        assert [r.token_ids for r in got] == [r.token_ids for r in expected], round_
    stats = on.speculator.stats
    accepted = sum(s.accepted for s in stats.values())
    assert stats["prompt"].steps > 0 and accepted > 0, stats
    assert stats["radix"].drafted > 0, stats  # the second round found the first's text
    assert sum(s.emitted for s in stats.values()) > sum(s.steps for s in stats.values())
    _check_no_leak(on)


def test_every_request_alone_and_in_a_batch_gets_its_tokens(smol):
    off, on = smol
    prompts = _copy_prompts(off)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    alone = [on.generate([p], params)[0].token_ids for p in prompts]
    together = [r.token_ids for r in on.generate(prompts, params)]
    assert alone == together == [r.token_ids for r in off.generate(prompts, params)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=64, temperature=0.8, seed=7),
        SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, top_k=40, seed=3, n=2),
        SamplingParams(
            max_tokens=64,
            temperature=0.0,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            repetition_penalty=1.1,
        ),  # fmt: skip
        SamplingParams(max_tokens=64, temperature=0.0, logprobs=3),
        SamplingParams(max_tokens=64, temperature=0.0, stop=["multiply"]),
        SamplingParams(max_tokens=64, temperature=0.0, min_tokens=20),
    ],
    ids=["seeded", "seeded-n2-topk-topp", "penalties", "logprobs", "stop", "min-tokens"],
)
def test_sampling_options_give_the_same_tokens(smol, params):
    off, on = smol
    prompts = _copy_prompts(off)[:2]
    expected = off.generate(prompts, params)
    before = sum(s.steps for s in on.speculator.stats.values())
    got = on.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.text for r in got] == [r.text for r in expected]
    if params.logprobs is not None:
        assert [r.logprobs for r in got] == [r.logprobs for r in expected]
    assert sum(s.steps for s in on.speculator.stats.values()) > before  # it did speculate
    _check_no_leak(on)


def test_no_draft_crosses_a_cache_scope():
    """Bob's request ends with text only Alice's answer holds: the draft index, which
    holds Alice's tokens under her scope, drafts nothing for Bob, and drafts for Alice."""
    engine = _pin_cost(make_engine(TINY, kv_cache_memory_gib=0.1, speculative_method="radix"))
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompt = engine.tokenizer.encode("The harbour master kept a log of every ship.")
    rid = engine.add_request(prompt, params, cache_scope="alice")
    while engine.has_unfinished():
        engine.step()
    assert rid not in engine.intake.requests
    spaces = engine.speculator.index._spaces
    assert len(spaces) == 1 and None not in spaces  # Alice's scope only
    (alice,) = spaces
    tokens = next(iter(spaces[alice].sequences.values()))  # her prompt and answer
    assert len(tokens) == len(prompt) + 24
    for scope, expect_draft in (("bob", False), ("alice", True)):
        # her prompt and the start of her answer: greedy, the same next token as hers
        rid = engine.add_request(tokens[: len(prompt) + 4], params, cache_scope=scope)
        engine.step()  # its prompt and first token
        engine.speculator.propose(engine.scheduler.running, engine.max_model_len)
        req = engine.intake.requests[rid]
        assert bool(req.draft) is expect_draft, scope
        engine.abort(rid)
    _check_no_leak(engine)


def test_off_by_default_and_its_settings_are_checked():
    from pydantic import ValidationError

    from radixserve.settings import EngineSettings

    assert EngineSettings().speculative_method == "off"
    with pytest.raises(ValidationError, match="speculative_method"):
        EngineSettings(speculative_method="eagle")
    with pytest.raises(ValidationError, match="speculative_max_draft_tokens"):
        EngineSettings(speculative_max_draft_tokens=-1)


def _chi_square_critical(dof: int, z: float = 2.326) -> float:
    """The chi-square quantile at the normal quantile ``z`` (2.326: 0.99), by Wilson and
    Hilferty's approximation."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def test_unseeded_sampling_keeps_its_distribution():
    """Unseeded draws at temperature 0.8, off and with radix drafts planted to be wrong
    (after the prompt and any of its 20 likeliest first tokens, the index holds "the
    capital city of France is"): the fourth token of 200 answers each, as categories (those seen
    under 10 times on both sides together pooled), passes a chi-square test of
    homogeneity at 0.99, and the drafts were verified. Accepting a draft without
    checking it samples the fourth token after "the capital" (" city" then comes up), and fails. The global
    RNG is seeded for each side: the verdict is the same every run."""
    import collections

    import torch

    off = make_engine("default", kv_cache_memory_gib=0.1)
    on = make_engine("default", kv_cache_memory_gib=0.1, speculative_method="radix")
    # every draft verified whole, however many were missed (the policy would stop)
    on.speculator.draft_lengths = lambda worths, rows: [len(w) for w in worths]
    prompt = _copy_prompts(off)[2]
    top = off.generate([prompt], SamplingParams(max_tokens=1, logprobs=20))[0].logprobs[0]
    planted = off.tokenizer.encode(" the capital city of France is")
    for candidate in top.top_ids:
        on.speculator.index.add(None, [prompt[-2], prompt[-1], candidate, *planted])
    params = SamplingParams(max_tokens=4, temperature=0.8)  # the fourth token is the subject
    counts = []
    for engine in (off, on):
        torch.manual_seed(1234)
        seen: collections.Counter[int] = collections.Counter()
        for _ in range(50):  # batches of 4 (speculation stands down in big batches)
            for r in engine.generate([prompt] * 4, params):
                seen[r.token_ids[3] if len(r.token_ids) > 3 else -1] += 1
        counts.append(seen)
    radix = on.speculator.stats["radix"]
    assert radix.drafted >= 100, radix  # most answers had the planted draft verified
    common = [k for k in counts[0].keys() | counts[1].keys() if counts[0][k] + counts[1][k] >= 10]
    rows = [[c[k] for k in common] + [sum(c.values()) - sum(c[k] for k in common)] for c in counts]
    cols = [a + b for a, b in zip(*rows)]
    if cols[-1] == 0:
        rows, cols = [r[:-1] for r in rows], cols[:-1]
    total = sum(cols)
    stat = sum((rows[i][j] - sum(rows[i]) * cols[j] / total) ** 2 / (sum(rows[i]) * cols[j] / total)
               for i in range(2) for j in range(len(cols)))  # fmt: skip
    assert len(cols) >= 3, cols  # a distribution with some spread, or the test says little
    assert stat < _chi_square_critical(len(cols) - 1), (stat, counts)
