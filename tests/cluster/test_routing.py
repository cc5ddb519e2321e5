"""Decode routing through the real gateway: with two decode workers (and no prefill
worker, so each prefills locally and only its own cache can serve a prefix), concurrent
conversations that share no prefix spread over both workers by load, and each
conversation's next turn goes back to the worker that holds it: its `cached_tokens`
covers the whole first turn.

The cluster serves the tiny model (the `tiny_model` fixture): the subject is the
gateway's routing, not the model's text. A turn of the tiny model takes a tenth of a
second, so the first turns are made concurrent by construction rather than by the
model's slowness: the decode workers are stopped (SIGSTOP) until the gateway has routed
both, so neither can finish before the other is routed. The first turns are 12 tokens:
the random model's text re-encodes to the same tokens there, so the next turn's prompt
starts with the tokens the worker cached."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.cluster.cluster_helpers import PATIENT, TestCluster, stopped, wait_workers
from tests.cluster.prompts import SYSTEM

PAGE = 16
DECODERS = ("decode-0", "decode-1")


@pytest.fixture(scope="module")
def two_decoders(tiny_model):
    cluster = TestCluster(num_prefill=0, num_decode=2, model=tiny_model, decode=PATIENT,
                          gateway=PATIENT, kvstore=PATIENT)  # fmt: skip
    yield cluster
    cluster.stop()


def test_conversations_spread_by_load_then_stick_to_their_worker(two_decoders):
    cluster = two_decoders
    conversations = [
        [{"role": "system", "content": f"You work at our {name} branch. {SYSTEM}"},
         {"role": "user", "content": "When do you open on Saturday?"}]
        for name in ("North", "South")
    ]  # fmt: skip

    async def ask_all(bodies, together=False):
        """With ``together``, every request is routed before any can finish."""
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:

            def post(b):
                return asyncio.ensure_future(client.post("/v1/chat/completions", json=b))

            if together:
                with stopped(cluster, DECODERS):
                    requests = [post(b) for b in bodies]
                    await wait_workers(
                        client,
                        lambda w: sum(w[n]["gateway_in_flight"] for n in DECODERS) == len(bodies),
                        "the gateway to route every request",
                    )
            else:
                requests = [post(b) for b in bodies]
            replies = await asyncio.gather(*requests)
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json() for r in replies]

    def body(messages, max_tokens):
        return {"messages": messages, "max_tokens": max_tokens, "temperature": 0}

    first = asyncio.run(ask_all([body(m, 12) for m in conversations], together=True))
    cluster.wait_clean()
    served = {
        n: w.get("local_prefills_total", 0)
        for n, w in cluster.workers().items()
        if w["role"] == "decode"
    }
    assert served == {"decode-0": 1, "decode-1": 1}  # one each: load beat the tie-break

    for messages, reply in zip(conversations, first):
        messages += [
            {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And on Sunday?"},
        ]
    second = asyncio.run(ask_all([body(m, 4) for m in conversations]))
    for turn1, turn2 in zip(first, second):
        usage1, usage2 = turn1["usage"], turn2["usage"]
        held = (usage1["prompt_tokens"] + usage1["completion_tokens"] - 1) // PAGE * PAGE
        assert usage2["prompt_tokens_details"]["cached_tokens"] == held
    cluster.wait_clean()
