"""Engines loaded once per session: the real default model (SmolLM2-135M-Instruct) with the
engine's defaults and in float32 (the transformers comparisons), and the tiny random-init
one with its tokenizer (`engine_helpers.TINY`)."""

from __future__ import annotations

import pytest

from tests.engine.engine_helpers import FLOAT32, TINY, make_engine


@pytest.fixture(scope="session")
def smol_on():
    return make_engine("default", kv_cache_memory_gib=0.25)


@pytest.fixture(scope="session")
def smol_off():
    return make_engine("default", kv_cache_memory_gib=0.25, prefix_cache=False)


@pytest.fixture(scope="session")
def smol_float32():
    """The default model in float32 with float32 weights: transformers' reference."""
    return make_engine("default", kv_cache_memory_gib=0.1, prefix_cache=False, **FLOAT32)


@pytest.fixture(scope="session")
def tiny_on():
    return make_engine(TINY, kv_cache_memory_gib=0.25)


@pytest.fixture(scope="session")
def tiny_off():
    return make_engine(TINY, kv_cache_memory_gib=0.25, prefix_cache=False)
