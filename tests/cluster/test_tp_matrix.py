"""Tensor-parallel pairs across the cluster (make bench-test: each case starts its own
cluster of 4-7 processes). On the tiny model (4 query / 2 KV heads; float32), every
prompt prefilled remotely:

- prefill TP=2 -> decode TP=1, TP=1 -> TP=2 and TP=2 -> TP=2, over NIXL and ZMQ: the
  answers equal the single-process engine's, and KV pages moved;
- a decode TP=1 worker writes a prefix through to the host tier, and a restarted prefill
  worker of TP=2 loads it from there, each rank its heads of the whole pages (the other
  direction of tests/cluster/test_tp_cluster.py's);
- prefill TP=2 -> decode TP=3 (a model of 6 query and 6 KV heads, which splits both
  ways): the decode worker refuses the link at handshake, naming both sizes, and prefills
  every prompt itself: nothing hangs and every answer is right.

tests/cluster/test_tp_cluster.py runs TP=1 -> TP=2 over NIXL and the host tier in make
test; the chaos benchmark's kill-rank event (tests/bench/test_chaos.py) kills ranks."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.settings import EngineSettings
from tests.cluster.cluster_helpers import TestCluster
from tests.cluster.prompts import QUESTIONS, SYSTEM, chat
from tests.cluster.test_tp_cluster import spill_then_load
from tests.engine.engine_helpers import tiny_checkpoint, write_tiny_model

MAX_TOKENS = 12
REMOTE = {"LOCAL_PREFILL_MAX_TOKENS": "0"}

pytestmark = [pytest.mark.benchmark, pytest.mark.slow]


def _ask_all(cluster: TestCluster, reference, system: str) -> None:
    for question in QUESTIONS[:2]:
        answer = cluster.ask(chat(question, system), MAX_TOKENS)
        assert answer["choices"][0]["message"]["content"] == reference(
            chat(question, system), MAX_TOKENS
        )


@pytest.mark.parametrize(
    ("transport", "prefill_tp", "decode_tp"),
    [("nixl", 2, 1), ("nixl", 2, 2), ("zmq", 2, 1), ("zmq", 1, 2), ("zmq", 2, 2)],
)
def test_pairs_equal_single_process(
    tiny_model: str, tiny_float32_reference_chat, transport: str, prefill_tp: int, decode_tp: int
) -> None:
    cluster = TestCluster(transport=transport, model=tiny_model, prefill_tp=prefill_tp,
                          decode_tp=decode_tp, decode=REMOTE, float32=True)  # fmt: skip
    try:
        _ask_all(cluster, tiny_float32_reference_chat, f"[{uuid.uuid4().hex[:8]}] {SYSTEM}")
        cluster.wait_clean()
        decode = cluster.worker("decode-0")
        assert decode.get("kv_transfer_pages_total", 0) > 0, decode
        assert decode.get("local_prefills_total", 0) == 0, decode
    finally:
        cluster.stop()


def test_tp2_prefill_loads_what_tp1_decode_wrote_through(
    tiny_model: str, tiny_float32_reference_chat
) -> None:
    cluster = TestCluster(model=tiny_model, prefill_tp=2, float32=True,
                          decode={**REMOTE, "HOST_WRITE_THROUGH_USES": "1"})  # fmt: skip
    try:
        spill_then_load(cluster, tiny_float32_reference_chat)
    finally:
        cluster.stop()


def test_tp2_to_tp3_is_refused_at_handshake_and_decode_prefills_itself(
    tmp_path: Path, capfd
) -> None:
    model = write_tiny_model(tmp_path / "tiny-6-heads", tiny_checkpoint(6, 6, 192))
    reference = Engine(EngineSettings(model=str(model), device="cpu", dtype="float32",
                                      quantization="none", kv_cache_memory_gib=0.05,
                                      prefix_cache=False, load_progress=False))  # fmt: skip
    cluster = TestCluster(model=str(model), prefill_tp=2, decode_tp=3, decode=REMOTE,
                          float32=True)  # fmt: skip
    try:
        system = f"[{uuid.uuid4().hex[:8]}] {SYSTEM}"
        for question in QUESTIONS[:2]:
            answer = cluster.ask(chat(question, system), MAX_TOKENS)
            ids = reference.tokenizer.encode_chat(chat(question, system))
            want = reference.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
            assert answer["choices"][0]["message"]["content"] == want[0].text
        cluster.wait_clean()
        decode = cluster.worker("decode-0")
        assert decode.get("remote_prefills_total", 0) == 0, decode
        assert decode.get("prefills_up", 0) == 0, decode
        assert decode.get("local_prefills_total", 0) >= 2, decode
    finally:
        cluster.stop()
    log = capfd.readouterr().err
    assert ("KV pages move between tensor-parallel sizes only when one divides the other: "
            "this side is TP=3, the peer TP=2") in log, log[-3000:]  # fmt: skip
