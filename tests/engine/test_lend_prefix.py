"""`Engine.lend_prefix`: the pages a worker lends another worker's `PeerRead` are only
those its cache holds for the same tokens in the same namespace (cache scope: the
tenant and salt; LoRA adapter), leased until released (or expired) and no longer.

The weights are checked before any read, by the link's handshake (the page geometry and
model identity: tests/cluster/test_peer_reads.py reads across processes); the adapter's
content by the owner against the reader's fingerprint (`Worker._lend`)."""

from __future__ import annotations

import time

import pytest

from radixserve.cache.block_hash import cache_scope
from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import TINY, assert_no_leaks, make_engine

PROMPT = (
    "Internal memo for the treasury team only. The quarterly hedging policy covers "
    "currency forwards, interest rate swaps and commodity options; every position over "
    "the limit needs two signatures. Question: who signs?"
)


@pytest.fixture(scope="module")
def engine():
    return make_engine(TINY, kv_cache_memory_gib=0.05)


def _serve(engine, prompt: str, scope: str) -> list[int]:
    """Serve ``prompt`` in ``scope`` (its prefix stays cached); its token ids."""
    ids = engine.tokenize(prompt)
    engine.add_request(ids, SamplingParams(max_tokens=1), cache_scope=scope)
    while engine.has_unfinished():
        engine.step()
    return ids


def test_a_prefix_is_lent_only_in_its_own_scope_and_only_until_released(engine):
    tenant_a, tenant_b = cache_scope(tenant="a"), cache_scope(tenant="b")
    ids = _serve(engine, PROMPT * 3, tenant_a)
    size = engine.page_size
    full = (len(ids) - 1) // size
    assert full >= 3
    tokens = ids[: full * size]

    assert engine.lend_prefix("other-tenant", tokens, 0, full, 5.0, tenant_b) == []
    assert engine.lend_prefix("default-scope", tokens, 0, full, 5.0, "") == []
    other_tokens = [t + 1 for t in tokens]
    assert engine.lend_prefix("other-tokens", other_tokens, 0, full, 5.0, tenant_a) == []

    pages = engine.lend_prefix("mine", tokens, 1, full, 5.0, tenant_a)  # past one page
    assert len(pages) == full - 1
    assert engine.kv.leases.pages("mine") == pages
    assert engine.release_lease("mine")
    assert not engine.release_lease("mine")  # released once

    pages = engine.lend_prefix("expires", tokens, 0, full, 0.01, tenant_a)
    assert len(pages) == full
    time.sleep(0.02)
    engine.kv.expire_leases(time.perf_counter())
    assert not engine.release_lease("expires")  # it had expired
    assert_no_leaks(engine)


def test_an_adapter_not_loaded_lends_nothing_and_says_so(engine):
    from radixserve.errors import UnknownAdapterError

    with pytest.raises(UnknownAdapterError, match="no LoRA adapter 'nope'"):
        engine.lend_prefix("x", engine.tokenize(PROMPT), 0, 2, 5.0, "", "nope")
