"""The new API shapes through the real cluster (gateway, prefill, decode processes,
NIXL; the default model): the official `openai` client parses logprobs (both endpoints), n choices, echo
with prompt logprobs, batched prompts and JSON mode, streamed and not. Every prompt
prefills on the prefill worker (the ``remote`` cluster), so the first token's log-probabilities, the
prompt's, and every choice's first token come back from it: they equal the
single-process engine's, and n = 4 computes the prompt once."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from radixserve.engine.sampling_params import SamplingParams
from tests.cluster.cluster_helpers import TestCluster
from tests.cluster.prompts import SYSTEM

TOL = 1e-4


SHARED_CLUSTER = "remote"  # shared with other modules: tests/cluster/conftest.py


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0) as c:
        yield c


def _counter(cluster: TestCluster, worker: str, key: str) -> float:
    return float(cluster.workers()[worker].get(key, 0))


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_n_choices_compute_the_prompt_once_with_remote_logprobs(cluster, oai, reference_engine):
    # a system prompt no earlier test on this shared cluster has cached
    messages = [{"role": "system", "content": f"[n choices] {SYSTEM}"},
                {"role": "user", "content": "What are the opening hours on Monday?"}]  # fmt: skip
    prompt_ids = reference_engine.tokenizer.encode_chat(messages)
    assert len(prompt_ids) > 256  # the decode worker sends it to the prefill worker
    cluster.wait_clean()
    computed = _counter(cluster, "prefill-0", "prefill_computed_tokens_total")
    remote = _counter(cluster, "decode-0", "remote_prefills_total")
    r = oai.chat.completions.create(
        model="default",
        messages=messages,
        n=4,
        temperature=0.8,
        seed=7,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
    )
    cluster.wait_clean()
    assert _counter(cluster, "decode-0", "remote_prefills_total") == remote + 1
    assert _counter(cluster, "prefill-0", "prefill_computed_tokens_total") - computed == len(
        prompt_ids
    )  # once, not 4 times
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 4
    for c in r.choices:
        assert len(c.logprobs.content) >= 1 and len(c.logprobs.content[0].top_logprobs) == 2
    again = oai.chat.completions.create(model="default", messages=messages, n=4,
                                        temperature=0.8, seed=7, max_tokens=8)  # fmt: skip
    assert [c.message.content for c in again.choices] == texts  # seeded: reproducible
    # greedy logprobs (the first token's from the prefill worker) equal one process's
    g = oai.chat.completions.create(
        model="default",
        messages=_messages("Is Wi-Fi free?"),
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
    )
    ref = reference_engine.generate(
        [reference_engine.tokenizer.encode_chat(_messages("Is Wi-Fi free?"))],
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=3),
    )[0]
    assert g.choices[0].message.content == ref.text
    got = [e.logprob for e in g.choices[0].logprobs.content]
    assert got == pytest.approx([lp.logprob for lp in ref.logprobs], abs=TOL)
    assert all(e.top_logprobs[0].token == e.token for e in g.choices[0].logprobs.content)


def test_echo_prompt_logprobs_batches_and_streams(cluster, oai, reference_engine):
    prompt = SYSTEM + "Question: can I renew a DVD online?\nAnswer:"
    scored = oai.completions.create(model="default", prompt=prompt, echo=True, max_tokens=0,
                                    logprobs=1, temperature=0)  # fmt: skip
    ref = reference_engine.generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    )[0]
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([x.logprob for x in ref.prompt_logprobs],
                                                  abs=TOL)  # fmt: skip
    batch = oai.completions.create(
        model="default",
        temperature=0,
        max_tokens=4,
        prompt=[prompt, "The sky is", "One, two,"],
        logprobs=2,
    )
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in batch.choices)
    stream = list(
        oai.completions.create(
            model="default",
            prompt=prompt,
            n=2,
            temperature=0,
            max_tokens=5,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    tokens = 0
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens += len(c.logprobs.tokens) if c.logprobs else 0
    assert sorted(texts) == [0, 1] and texts[0] == texts[1]
    assert stream[-1].usage.completion_tokens == tokens >= 2
    chat = list(oai.chat.completions.create(model="default", messages=_messages("Hi"),
                                            temperature=0, max_tokens=5, logprobs=True,
                                            stream=True))  # fmt: skip
    entries = [e for c in chat if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]  # fmt: skip
    assert len(entries) >= 1
    cluster.wait_clean()


def test_json_schema_through_the_cluster(cluster, oai):
    schema = {"type": "object", "additionalProperties": False, "required": ["day", "open"],
              "properties": {"day": {"enum": ["Monday", "Saturday", "Sunday"]},
                             "open": {"type": "boolean"}}}  # fmt: skip
    for stream in (False, True):
        kwargs = dict(
            model="default",
            messages=_messages("Is the library open on Sunday?"),
            temperature=0,
            max_tokens=30,
            stream=stream,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
        r = oai.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        else:
            text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
    mode = oai.chat.completions.create(
        model="default",
        messages=_messages("Answer in JSON."),
        temperature=0,
        max_tokens=24,
        response_format={"type": "json_object"},
    )
    assert mode.choices[0].message.content.startswith("{")
    cluster.wait_clean()
