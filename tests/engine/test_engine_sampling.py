"""Sampling options through the whole engine (the tiny random-init model with the default
model's tokenizer; the real one where only its choices show, such as when it stops)."""

from __future__ import annotations

from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import assert_no_leaks

PROMPT = "Here is a list of fruits: apple, banana,"


def test_seeded_sampling_is_reproducible(tiny_on):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    first, second = tiny_on.generate([PROMPT, PROMPT], params)  # same batch, same seed
    [third] = tiny_on.generate([PROMPT], params)
    assert first.token_ids == second.token_ids == third.token_ids
    others = {
        tuple(r.token_ids)
        for r in tiny_on.generate(
            [PROMPT] * 4, SamplingParams(max_tokens=12, temperature=1.5, seed=None)
        )
    }
    assert len(others) > 1  # unseeded high-temperature samples differ
    assert_no_leaks(tiny_on)


def test_stop_string_truncates_text(tiny_on):
    [free] = tiny_on.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0))
    stop = free.text[len(free.text) // 2 :][:3]  # three characters from the middle on
    stop_at = free.text.index(stop)
    [stopped] = tiny_on.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop])
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:stop_at]


def test_stop_token_ids_and_min_tokens(tiny_on):
    [free] = tiny_on.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0))
    stop_id = free.token_ids[3]
    [stopped] = tiny_on.generate(
        [PROMPT], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_id])
    )
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert stopped.finish_reason == "stop"
    # min_tokens forbids stop tokens until it is reached
    [held] = tiny_on.generate(
        [PROMPT],
        SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0, stop_token_ids=[stop_id]),
    )
    assert len(held.token_ids) == 10 and stop_id not in held.token_ids
    assert held.finish_reason == "length"


def test_eos_ends_generation_unless_ignored(smol_on):
    # the real model: random weights would not choose to stop
    chat = smol_on.tokenizer.encode_chat([{"role": "user", "content": "Say hi."}])
    [normal] = smol_on.generate([chat], SamplingParams(max_tokens=64, temperature=0.0))
    assert normal.finish_reason == "stop"
    assert normal.token_ids[-1] in smol_on.config.eos_token_ids
    assert "<|im_end|>" not in normal.text
    n = len(normal.token_ids) + 4
    [ignored] = smol_on.generate(
        [chat], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    )
    assert len(ignored.token_ids) == n and ignored.finish_reason == "length"
    assert ignored.token_ids[: len(normal.token_ids)] == normal.token_ids


def test_kept_special_tokens_are_in_the_text(tiny_on):
    """Special tokens are left out of the text unless the request keeps them (a tool
    parser's markers): here the default tokenizer's <|im_start|>, forced by a bias."""
    marker = tiny_on.tokenizer.token_to_id("<|im_start|>")
    forced = {"max_tokens": 3, "temperature": 0.0, "logit_bias": {marker: 100.0}}
    [skipped] = tiny_on.generate([PROMPT], SamplingParams(**forced))
    [kept] = tiny_on.generate([PROMPT], SamplingParams(**forced, kept_special_ids=[marker]))
    assert skipped.token_ids == kept.token_ids == [marker] * 3
    assert skipped.text == "" and kept.text == "<|im_start|>" * 3
    assert_no_leaks(tiny_on)
