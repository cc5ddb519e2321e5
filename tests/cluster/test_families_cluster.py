"""The model families through a real cluster (`LocalCluster`, what ``radixserve up``
runs): Qwen3, Qwen3-MoE (a dense layer between sparse ones), Mixtral and Gemma 3 (a
window of 8, shorter than every prompt), each a tiny random-init model from
`tests/engine/test_families.py` saved as safetensors, with the engine's defaults as
every cluster test.

For each family one cluster — a prefill worker, a decode worker that prefills nothing
itself (``local_prefill_max_tokens`` 0) and writes each prefix through to the kvstore's
host tier — answers:

- prompts prefilled remotely, their pages moved over NIXL: the single-process engine's
  answer, token for token;
- a prompt whose prefix the prefill worker, killed and restarted meanwhile (an empty
  device cache), loads from the host tier: the single-process answer again, the load
  counted.

The four clusters run one after another (one up at a time). make test runs Qwen3-MoE's
and Gemma 3's, whose forward passes differ most from the others (experts; windows, their
own norms); Qwen3's and Mixtral's, 30 s more on 2 cores, run in make bench-test (all four
are exact in one process in tests/engine/test_families.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.cluster.cluster_helpers import TestCluster, memoised_chat
from tests.cluster.prompts import QUESTIONS, SYSTEM, chat
from tests.cluster.test_tp_cluster import MAX_TOKENS, counter, spill_then_load
from tests.engine.engine_helpers import make_engine
from tests.engine.test_families import FAMILIES
from tests.model.tiny_checkpoints import write_tiny_checkpoint

FAMILY_PARAMS = [
    pytest.param("qwen3", marks=pytest.mark.benchmark),
    "qwen3_moe",
    pytest.param("mixtral", marks=pytest.mark.benchmark),
    "gemma3",
]


@pytest.fixture(scope="module", params=FAMILY_PARAMS)
def family(request, tmp_path_factory) -> Iterator[tuple[str, TestCluster, object]]:
    """(name, its cluster, its single-process greedy chat answer)."""
    name = request.param
    # room for the host-tier test's long system prompt in the tiny BPE's tokens
    kwargs = {**FAMILIES[name], "max_position_embeddings": 4096}
    path = str(write_tiny_checkpoint(tmp_path_factory.mktemp(name), **kwargs))
    reference = make_engine(path, kv_cache_memory_gib=0.05, prefix_cache=False)
    cluster = TestCluster(
        transport="nixl", model=path,
        decode={"LOCAL_PREFILL_MAX_TOKENS": "0", "HOST_WRITE_THROUGH_USES": "1"},
    )  # fmt: skip
    try:
        yield name, cluster, memoised_chat(reference)
    finally:
        cluster.stop()


def test_remote_prefill_over_nixl_equals_single_process(family) -> None:
    name, cluster, reference = family
    before = counter(cluster, "decode-0", "kv_transfer_pages_total")
    system = f"[{uuid.uuid4().hex[:8]}] {SYSTEM}"
    for question in QUESTIONS[:2]:
        answer = cluster.ask(chat(question, system), MAX_TOKENS)
        assert answer["choices"][0]["message"]["content"] == reference(
            chat(question, system), MAX_TOKENS
        ), name
    cluster.wait_clean()
    assert counter(cluster, "decode-0", "kv_transfer_pages_total") > before
    assert counter(cluster, "decode-0", "remote_prefills_total") >= 2


def test_a_prefix_from_the_host_tier_equals_single_process(family) -> None:
    _, cluster, reference = family
    spill_then_load(cluster, reference)
