"""Engines loaded once per session: the real default model (SmolLM2-135M-Instruct, fp32)
and the tiny random-init one with its tokenizer (`engine_helpers.TINY`)."""

from __future__ import annotations

import pytest

from tests.engine.engine_helpers import TINY, make_engine


@pytest.fixture(scope="session")
def smol_on():
    return make_engine("default", kv_cache_memory_gib=0.25)


@pytest.fixture(scope="session")
def smol_off():
    return make_engine("default", kv_cache_memory_gib=0.25, prefix_cache=False)


@pytest.fixture(scope="session")
def tiny_on():
    return make_engine(TINY, kv_cache_memory_gib=0.25)


@pytest.fixture(scope="session")
def tiny_off():
    return make_engine(TINY, kv_cache_memory_gib=0.25, prefix_cache=False)
