"""Engines on the real default model (SmolLM2-135M-Instruct, fp32), loaded once per session."""

from __future__ import annotations

import pytest

from tests.engine.engine_helpers import make_engine


@pytest.fixture(scope="session")
def smol_on():
    return make_engine("default", kv_cache_memory_gib=0.25)


@pytest.fixture(scope="session")
def smol_off():
    return make_engine("default", kv_cache_memory_gib=0.25, prefix_cache=False)
