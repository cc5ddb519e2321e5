"""Log-probabilities equal transformers' on the same weights: the prompt's (echo) and a
greedy continuation's, with top-k alternatives; a prompt-scoring request recomputes a
cached prefix, so the cache on gives what the cache off gives."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve.engine.logprobs import token_logprobs
from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import FLOAT32, assert_no_leaks, make_engine
from tests.model.tiny_checkpoints import write_tiny_checkpoint

K = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("lp"), arch="llama", tie=False)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check(lp, expected_row: torch.Tensor, token: int) -> None:
    assert lp.token_id == token
    assert lp.logprob == pytest.approx(float(expected_row[token]), abs=1e-4)
    values, order = expected_row.topk(K)
    assert list(lp.top_ids) == order.tolist()
    torch.testing.assert_close(torch.tensor(lp.top_logprobs), values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("prompt_len", [6, 37])
def test_prompt_and_greedy_logprobs_match_transformers(tiny, prompt_len):
    path, hf = tiny
    engine = make_engine(
        str(path), page_size=4, max_num_batched_tokens=16, **FLOAT32
    )  # chunked prefill; fmt: skip
    prompt = _ids(prompt_len, engine.config.vocab_size, prompt_len)
    params = SamplingParams(
        max_tokens=6, min_tokens=6, temperature=0.0, logprobs=K, prompt_logprobs=K
    )
    [result] = engine.generate([prompt], params)
    full = prompt + result.token_ids
    expected = _hf_logprobs(hf, full)  # (T, V): row p scores token p + 1
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == prompt_len - 1
    for q, lp in enumerate(result.prompt_logprobs, start=1):
        _check(lp, expected[q - 1], full[q])
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for i, lp in enumerate(result.logprobs):
        _check(lp, expected[prompt_len - 1 + i], result.token_ids[i])
        assert lp.top_ids[0] == result.token_ids[i]  # greedy: the most likely token
    assert_no_leaks(engine)


def test_prompt_scores_ignore_the_cache_and_equal_cache_off(tiny):
    path, _ = tiny
    on = make_engine(str(path), page_size=4)
    off = make_engine(str(path), page_size=4, prefix_cache=False)
    prompt = _ids(19, on.config.vocab_size, 7)
    plain = SamplingParams(max_tokens=3, temperature=0.0)
    scored = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=2)
    first = on.generate([prompt], plain)[0]
    [cached] = on.generate([prompt], scored)
    [reference] = off.generate([prompt], scored)
    assert cached.cached_tokens == 0 and cached.computed_prompt_tokens == len(prompt)
    assert cached.token_ids == reference.token_ids == first.token_ids
    assert cached.prompt_logprobs == reference.prompt_logprobs
    assert cached.logprobs == reference.logprobs
    # without prompt scores the cache is used as before
    assert on.generate([prompt], plain)[0].cached_tokens > 0
    assert_no_leaks(on)
    assert_no_leaks(off)


def test_new_fields_give_the_same_tokens_with_the_cache_on_and_off(tiny):
    path, _ = tiny
    on = make_engine(str(path), page_size=4)
    off = make_engine(str(path), page_size=4, prefix_cache=False)
    prompt = _ids(23, on.config.vocab_size, 11)
    variants = [
        SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=1.5,
                       frequency_penalty=0.5, repetition_penalty=1.3, logprobs=3),
        SamplingParams(max_tokens=8, temperature=0.0, logit_bias={5: 4.0, 9: -50.0}, n=2),
        SamplingParams(max_tokens=8, temperature=0.9, seed=4, n=3, min_p=0.05),
        SamplingParams(max_tokens=8, temperature=0.0, guide_kind="regex", guide="[a-z]{3,6}"),
    ]  # fmt: skip
    on.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))  # cache the prompt
    for params in variants:
        cached = on.generate([prompt], params)
        fresh = off.generate([prompt], params)
        assert cached[0].cached_tokens > 0
        assert [r.token_ids for r in cached] == [r.token_ids for r in fresh]
        for a, b in zip(cached, fresh):  # the cached prefix's KV: equal within fp32 rounding
            if a.logprobs is not None:
                assert [x.top_ids for x in a.logprobs] == [y.top_ids for y in b.logprobs]
                assert [x.logprob for x in a.logprobs] == pytest.approx(
                    [y.logprob for y in b.logprobs], abs=1e-4
                )
    assert_no_leaks(on)
    assert_no_leaks(off)


def test_equal_logprobs_list_the_lowest_id_first():
    """Greedy sampling takes the lowest of equal top logits (argmax); the top list puts
    it first too, and fills a tie at its cut with the lowest ids (`torch.topk` leaves
    the order of equals open: bfloat16 logits tie often)."""
    vocab = 4096
    logits = torch.zeros(3, vocab)
    logits[0, [3000, 7, 1500]] = 2.0  # three-way tie at the top
    logits[1, 9] = 5.0
    logits[1, [4000, 300, 2000]] = 1.0  # a tie at the cut of 3
    logits[2, [11, 12]] = torch.tensor([3.0, 2.0])  # no tie
    greedy = logits.argmax(-1).tolist()
    out = token_logprobs(logits, greedy, [2, 3, 2])
    assert [lp.top_ids for lp in out] == [(7, 1500), (9, 300, 2000), (11, 12)]
    assert all(lp.top_ids[0] == token for lp, token in zip(out, greedy))
    assert out[0].top_logprobs[0] == out[0].top_logprobs[1] == out[0].logprob
