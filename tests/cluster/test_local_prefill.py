"""The decode worker's own choice of route, on the real cluster over ZMQ (the
``default-tiny`` cluster: `local_prefill_max_tokens` at its default; the tiny model, the
same weights in one process for the reference): a long first turn prefills on the
prefill worker, and a short delta on a known prefix prefills locally with nothing moved;
both answers equal the single-process engine's.

The system prompt is new to the cluster each run (the cluster is shared with
test_kvstore and test_bench_url), and counters are read as deltas."""

from __future__ import annotations

import uuid

from radixserve.engine.sampling_params import SamplingParams
from tests.cluster.cluster_helpers import TestCluster
from tests.cluster.prompts import QUESTIONS, SYSTEM, chat

MAX_TOKENS = 12
PAGE = 16

SHARED_CLUSTER = "default-tiny"  # shared with other modules: tests/cluster/conftest.py


def decode_counters(cluster: TestCluster) -> dict[str, float]:
    cluster.wait_clean()  # also lets the heartbeats carry the latest counters
    decode = cluster.workers()["decode-0"]
    keys = ("remote_prefills_total", "local_prefills_total", "kv_transfer_pages_total")
    return {key: float(decode.get(key, 0)) for key in keys}


def test_remote_then_local_prefill_over_zmq_equal_single_process(cluster, tiny_reference_chat):
    system = f"[{uuid.uuid4().hex[:8]}] {SYSTEM}"
    start = decode_counters(cluster)
    # first sight of the system prompt: over 256 uncached tokens -> remote prefill
    first = cluster.ask(chat(QUESTIONS[0], system), MAX_TOKENS)
    after_first = decode_counters(cluster)
    assert after_first["remote_prefills_total"] == start["remote_prefills_total"] + 1
    assert after_first["local_prefills_total"] == start["local_prefills_total"]
    assert after_first["kv_transfer_pages_total"] > start["kv_transfer_pages_total"]
    # the system prompt is now cached on decode: a new question is a small delta -> local
    second = cluster.ask(chat(QUESTIONS[1], system), MAX_TOKENS)
    after_second = decode_counters(cluster)
    assert after_second["local_prefills_total"] == start["local_prefills_total"] + 1
    assert after_second["kv_transfer_pages_total"] == after_first["kv_transfer_pages_total"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(SYSTEM) // 8
    for answer, question in ((first, QUESTIONS[0]), (second, QUESTIONS[1])):
        want = tiny_reference_chat(chat(question, system), MAX_TOKENS)
        assert answer["choices"][0]["message"]["content"] == want


def test_a_second_turn_prefills_its_short_delta_locally_and_moves_nothing(
    cluster, tiny_reference_engine
):
    messages = chat("Can I bring my dog?", f"[{uuid.uuid4().hex[:8]}] {SYSTEM}")
    turn1 = cluster.ask(messages, 20)
    # turn 1's tokens, as the single process computes them (its text is the cluster's)
    tokenizer = tiny_reference_engine.tokenizer
    prompt_ids = tokenizer.encode_chat(messages)
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    answer = tiny_reference_engine.generate([prompt_ids], greedy)[0]
    assert turn1["choices"][0]["message"]["content"] == answer.text
    before = decode_counters(cluster)
    messages += [
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": "And my cat?"},
    ]
    turn2 = cluster.ask(messages, 8)
    after = decode_counters(cluster)
    # decode kept turn 1 (prompt + answer, less the unwritten last token) in its cache; a
    # second turn reuses the full pages it shares with that. The random model's answer
    # text need not encode back to the tokens it was made of, so what is shared is
    # counted on the tokens, not assumed to be all of turn 1
    held = prompt_ids + answer.token_ids[:-1]
    shared = common_prefix(held, tokenizer.encode_chat(messages))
    assert shared >= len(prompt_ids)  # at least the whole first prompt
    cached = turn2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == shared // PAGE * PAGE
    assert after["local_prefills_total"] == before["local_prefills_total"] + 1
    assert after["kv_transfer_pages_total"] == before["kv_transfer_pages_total"]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
