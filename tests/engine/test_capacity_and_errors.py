"""Small pools evict and preempt but stay correct; impossible or bad requests fail clearly."""

from __future__ import annotations

import logging

import pytest
import torch

from radixserve.engine.device import resolve_dtype
from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import CapacityError, InvalidRequestError, ModelLoadError
from tests.engine.engine_helpers import TINY, assert_no_leaks, make_engine

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
# One page of the tiny model's 16 tokens in the default dtype:
# 2 layers * 2 * 2 kv heads * 16 dims * 16 tokens * the dtype's bytes.
PAGE_BYTES = 2 * 2 * 2 * 16 * 16 * resolve_dtype("auto", torch.device("cpu")).itemsize


def _small_engine(num_pages: int, **kw):
    return make_engine(TINY, kv_cache_memory_gib=num_pages * PAGE_BYTES / 2**30, **kw)


@pytest.fixture(scope="module")
def tiny_pool():
    engine = _small_engine(24)
    assert engine.allocator.num_pages == 24
    return engine


def test_conversations_larger_than_pool_complete_by_evicting(tiny_pool, tiny_off, caplog):
    """Six ~100-token conversations through a 384-token pool: one at a time they evict
    each other's cached pages; all at once they also need preemption."""
    topics = ["tides", "volcanoes", "bees", "glaciers", "comets", "coral reefs"]
    ask = "Write two facts about {}. Keep it short and simple, please, thanks. "
    prompts = [ask.format(t) * 4 for t in topics]
    # ~65-token prompts + 40 new tokens = 7 pages each; 4 fit at admission (5 pages each)
    # and must grow to 28 pages while decoding: more than the pool's 24.
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0.0)
    expected = [r.token_ids for r in tiny_off.generate(prompts, params)]
    for prompt, tokens in zip(prompts, expected):
        assert tiny_pool.generate([prompt], params)[0].token_ids == tokens
    assert tiny_pool.cache.num_cached_pages <= 24
    # and all at once, which needs preemption as well as eviction
    with caplog.at_level(logging.INFO, logger="radixserve.engine.scheduler"):
        assert [r.token_ids for r in tiny_pool.generate(prompts, params)] == expected
    assert any(r.getMessage().startswith("preempting ") for r in caplog.records)
    assert_no_leaks(tiny_pool)


def test_request_larger_than_pool_is_refused(tiny_pool):
    with pytest.raises(CapacityError, match="KV pool holds 384 tokens"):
        tiny_pool.add_request("word " * 380, SamplingParams(max_tokens=16))
    assert_no_leaks(tiny_pool)


def test_empty_prompt(tiny_on):
    for prompt in ("", []):
        with pytest.raises(InvalidRequestError, match="empty"):
            tiny_on.add_request(prompt)


def test_prompt_longer_than_context():
    engine = make_engine(TINY, kv_cache_memory_gib=0.05, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="context is 64 tokens"):
        engine.add_request(list(range(100, 170)))


def test_token_ids_outside_vocabulary(tiny_on):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        tiny_on.add_request([1, 2, 10**9])


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_non_positive_max_tokens(max_tokens):
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=max_tokens)


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        make_engine(str(tmp_path / "does-not-exist.gguf"))


def test_corrupt_checkpoint_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        make_engine(str(bad))


def test_abort_returns_every_page(tiny_on):
    prompt = "Tell me a very long story about a lighthouse keeper and the sea. " * 3
    rid = tiny_on.add_request(prompt, GREEDY)
    tiny_on.step()
    tiny_on.step()
    stats = tiny_on.cache_stats()
    assert stats["live_requests"] == 1 and stats["pages_locked"] >= 2
    assert stats["cache_locks"] == 1 and stats["page_refs_outside_cache"] >= 2
    out = tiny_on.abort(rid)
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert tiny_on.abort(rid) is None
    assert_no_leaks(tiny_on)
