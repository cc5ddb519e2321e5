"""Greedy outputs with the radix cache on are identical to the cache off (the tiny random-init
model: every position's logits depend on the whole context, as a real model's do)."""

from __future__ import annotations

import pytest

from radixserve.cache.block_hash import cache_scope
from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import TINY, assert_no_leaks, make_engine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)

SYSTEM = (
    "You are a meticulous support assistant for a company that sells solar panels, "
    "batteries and inverters. Answer briefly, cite the product manual section when you can, "
    "and never invent warranty terms. "
)


def _chat(engine, messages):
    return engine.tokenizer.encode_chat(messages)


def _tokens(results):
    return [r.token_ids for r in results]


def test_repeated_prompt_hits_cache_and_matches(tiny_on, tiny_off):
    prompt = SYSTEM + "How long does a battery last?"
    first, second = tiny_on.generate([prompt], GREEDY)[0], tiny_on.generate([prompt], GREEDY)[0]
    [ref] = tiny_off.generate([prompt], GREEDY)
    assert first.token_ids == second.token_ids == ref.token_ids
    assert second.cached_tokens > 0 and second.cached_tokens % tiny_on.page_size == 0
    assert second.computed_prompt_tokens == second.prompt_tokens - second.cached_tokens
    assert ref.cached_tokens == 0 and ref.computed_prompt_tokens == ref.prompt_tokens
    assert_no_leaks(tiny_on)
    assert_no_leaks(tiny_off)


@pytest.mark.parametrize("cut", [0, 5, 16, 21])
def test_shared_prefix_ending_mid_page(tiny_on, tiny_off, cut):
    """Prompts share `base + extra[:cut]` tokens, so the shared part ends mid-page."""
    base = tiny_on.tokenizer.encode(SYSTEM)
    extra = tiny_on.tokenizer.encode(" The customer writes from Norway about snow on panels.")
    shared = base + extra[:cut]
    q1 = tiny_on.tokenizer.encode(" Question: can snow damage them?")
    q2 = tiny_on.tokenizer.encode(" Question: how should I clean them?")
    first, second = tiny_on.generate([shared + q1], GREEDY) + tiny_on.generate(
        [shared + q2], GREEDY
    )
    off = _tokens(tiny_off.generate([shared + q1, shared + q2], GREEDY))
    assert _tokens([first, second]) == off
    # the second hit the first's pages: at least every full page of the shared part
    aligned = len(shared) // tiny_on.page_size * tiny_on.page_size
    assert second.cached_tokens >= aligned > 0, (second.cached_tokens, aligned)
    assert_no_leaks(tiny_on)


def test_multi_turn_chat_reuses_prompt_and_answer(smol_on, smol_off):
    """Turn N+1 = turn N's prompt + answer + a new question: cached_tokens covers turn N's
    prompt and answer (page-aligned) and only the rest is computed. On the real model: its
    answers re-tokenize through the chat template to the ids it produced."""
    messages = [{"role": "system", "content": SYSTEM}]
    questions = ["What does the inverter do?", "And the battery?", "Which one fails first?"]
    prev_kv_tokens = 0
    for turn, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        prompt = _chat(smol_on, messages)
        [on] = smol_on.generate([prompt], GREEDY)
        [off] = smol_off.generate([prompt], GREEDY)
        assert on.token_ids == off.token_ids, f"turn {turn}"
        if turn > 0:
            ps = smol_on.page_size
            assert on.cached_tokens == (prev_kv_tokens // ps) * ps
            assert on.computed_prompt_tokens == on.prompt_tokens - on.cached_tokens
        # KV of everything but the final sampled token is now in the cache.
        prev_kv_tokens = len(prompt) + len(on.token_ids) - 1
        answer = smol_on.tokenizer.decode(on.token_ids)
        messages.append({"role": "assistant", "content": answer})
        # The template renders the answer back to the same tokens the model produced.
        assert (
            _chat(smol_on, messages + [{"role": "user", "content": "x"}])[:prev_kv_tokens]
            == (prompt + on.token_ids)[:prev_kv_tokens]
        )
    assert_no_leaks(smol_on)


def test_batch_mixing_prefills_and_decodes(tiny_on, tiny_off):
    """Requests join while others decode; outputs equal each prompt run alone."""
    prompts = [SYSTEM + q for q in ("Hi!", "Is the warranty 10 years?", "Do panels work at night?")]
    alone = _tokens(tiny_off.generate([p], GREEDY)[0] for p in prompts)
    for engine in (tiny_on, tiny_off):
        results: dict[str, list[int]] = {}
        cached: dict[str, int] = {}

        def step(engine=engine, results=results, cached=cached):
            for out in engine.step():
                results.setdefault(out.request_id, []).extend(out.new_token_ids)
                cached[out.request_id] = out.cached.total

        ids = [engine.add_request(prompts[0], GREEDY)]
        for _ in range(3):
            step()  # prompt 0 is decoding now
        ids.append(engine.add_request(prompts[1], GREEDY))
        step()
        ids.append(engine.add_request(prompts[2], GREEDY))
        while engine.has_unfinished():
            step()
        assert [results[rid] for rid in ids] == alone
        if engine.cache is not None:  # the later ones found the system prompt cached
            assert all(cached[rid] >= engine.page_size for rid in ids[1:]), cached
        assert_no_leaks(engine)


def test_chunked_prefill_matches_single_pass(tiny_off):
    chunked = make_engine(TINY, kv_cache_memory_gib=0.25, max_num_batched_tokens=48)
    prompt = SYSTEM * 3 + "Summarise."
    assert _tokens(chunked.generate([prompt], GREEDY)) == _tokens(
        tiny_off.generate([prompt], GREEDY)
    )
    assert_no_leaks(chunked)


# -- cache scopes: requests share KV only within their scope ----------------------------

SCOPED_PROMPT = (
    "Internal memo for the treasury team only. The quarterly hedging policy covers "
    "currency forwards, interest rate swaps and commodity options; every position over "
    "the limit needs two signatures. Question: "
)


def _run_scoped(engine, prompt, scope, params=GREEDY):
    """Serve ``prompt`` in cache scope ``scope``; (every choice's tokens, cached tokens)."""
    rid = engine.add_request(prompt, params, cache_scope=scope)
    tokens: dict[int, list[int]] = {}
    cached = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens.setdefault(out.index, []).extend(out.new_token_ids)
                cached = out.cached.total
    return [tokens[i] for i in sorted(tokens)], cached


def test_scopes_share_nothing_and_answer_the_same(tiny_on, tiny_off):
    prompt = SCOPED_PROMPT + "who signs?"
    tenant_a, tenant_b = cache_scope(tenant="a"), cache_scope(tenant="b")
    [ref] = tiny_off.generate([prompt], GREEDY)
    a1, a1_cached = _run_scoped(tiny_on, prompt, tenant_a)
    b1, b1_cached = _run_scoped(tiny_on, prompt, tenant_b)  # the same prompt, another scope
    a2, a2_cached = _run_scoped(tiny_on, prompt, tenant_a)
    salted, salted_cached = _run_scoped(tiny_on, prompt, cache_scope(tenant="a", salt="s"))
    default, default_cached = _run_scoped(tiny_on, prompt, "")
    assert a1 == b1 == a2 == salted == default == [ref.token_ids]
    assert a1_cached == b1_cached == salted_cached == default_cached == 0
    size = tiny_on.page_size
    full = (len(tiny_on.tokenize(prompt)) - 1) // size * size  # never the last token
    assert a2_cached == full > 0  # the same scope shares
    _, default_again = _run_scoped(tiny_on, prompt, "")  # the default scope shares as before
    assert default_again == full
    assert_no_leaks(tiny_on)


def test_choices_of_a_scoped_request_stay_in_its_scope(tiny_on):
    prompt = SCOPED_PROMPT + "what needs two signatures?"
    params = SamplingParams(max_tokens=8, temperature=0.0, n=2)
    scope = cache_scope(tenant="forks")
    first, first_cached = _run_scoped(tiny_on, prompt, scope, params)
    again, again_cached = _run_scoped(tiny_on, prompt, scope, params)
    _, other_cached = _run_scoped(tiny_on, prompt, cache_scope(tenant="other"), params)
    assert first == again and len(first) == 2
    assert first_cached == other_cached == 0 and again_cached > 0
    assert_no_leaks(tiny_on)
