"""Fixtures for cluster tests: the single-process reference engine outputs are compared to."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_engine

Reference = Callable[[list[dict[str, str]], int], str]


@pytest.fixture(scope="session")
def reference_engine():
    """SmolLM2 fp32 on CPU with float32 weights (quantization=none), prefix cache off: what
    one process would answer. The clusters run the same: their checks compare many
    prompts token for token, across cached and uncached prompts, migrations and seeded
    draws, which holds at float32 rounding; the int4 path rounds to bfloat16, and its
    kernel and its prefill path round differently (tests/model/test_quant.py checks the
    quantized engine on its own)."""
    return make_engine("default", kv_cache_memory_gib=0.1, prefix_cache=False)


@pytest.fixture(scope="session")
def reference_chat(reference_engine) -> Reference:
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
