"""Fixtures for cluster tests: the single-process reference engine outputs are compared to."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_engine

Reference = Callable[[list[dict[str, str]], int], str]


@pytest.fixture(scope="session")
def reference_engine():
    """SmolLM2 on CPU as the clusters run it (fp32 compute, the GGUF's own int4 weights),
    prefix cache off: what one process would answer."""
    return make_engine("default", kv_cache_memory_gib=0.1, prefix_cache=False, quantization="auto")


@pytest.fixture(scope="session")
def reference_engine_exact():
    """The same with float32 weights (quantization=none): for the clusters whose checks
    need float32 rounding end to end — a migrated stream recomputes its generated tokens
    as a prompt, and seeded draws compare a cached prompt with an uncached one, where the
    int4 decode kernel and the prefill path's dense matmul round differently."""
    return make_engine("default", kv_cache_memory_gib=0.1, prefix_cache=False)


@pytest.fixture(scope="session")
def reference_chat(reference_engine) -> Reference:
    return _answers(reference_engine)


@pytest.fixture(scope="session")
def reference_chat_exact(reference_engine_exact) -> Reference:
    return _answers(reference_engine_exact)


def _answers(reference_engine) -> Reference:
    """Greedy answer text of the single-process engine to a chat, memoised."""
    memo: dict[tuple, str] = {}

    def answer(messages: list[dict[str, str]], max_tokens: int) -> str:
        key = (tuple((m["role"], m["content"]) for m in messages), max_tokens)
        if key not in memo:
            ids = reference_engine.chat_prompt_ids(messages)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            memo[key] = reference_engine.generate([ids], params)[0].text
        return memo[key]

    return answer
