"""Forced tool calls through `radixserve up`'s processes (the ``remote`` cluster: gateway,
prefill and decode workers, NIXL, every prompt prefilled remotely; the default model)
with the unmodified OpenAI SDK: with ``tool_choice`` "required" and with a named
function, sampled at temperature 1 from seeds 0..49, every call's arguments parse and
validate against the tool's schema. The draws differ from seed to seed, so it is the
grammar, not the model's preference, that makes them valid. The named calls stream,
reassembled by the SDK's stream helper from argument fragments.

`make test` runs seeds 0..4; the 50 seeds are a benchmark-marked run (make bench-test).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.gateway.test_tools import ASK, SCHEMAS, TOOLS

SHARED_CLUSTER = "remote"  # shared with other modules: tests/cluster/conftest.py
NAMED = {"type": "function", "function": {"name": "add"}}  # not what the question asks
FORCED = dict(model="default", messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=64)


def _required(oai: openai.OpenAI, seed: int) -> tuple[str, str]:
    r = oai.chat.completions.create(**FORCED, tool_choice="required", seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    return call.function.name, call.function.arguments


def _named_streamed(oai: openai.OpenAI, seed: int) -> tuple[str, str]:
    fragments = 0
    with oai.chat.completions.stream(**FORCED, tool_choice=NAMED, seed=seed) as stream:
        for event in stream:
            fragments += event.type == "tool_calls.function.arguments.delta"
        choice = stream.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert fragments > 1  # the arguments streamed as they were generated
    return call.function.name, call.function.arguments


def _check_forced_calls(cluster, seeds: range) -> None:
    with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0,
                       timeout=300) as oai, ThreadPoolExecutor(8) as pool:  # fmt: skip
        required = list(pool.map(lambda seed: _required(oai, seed), seeds))
        named = list(pool.map(lambda seed: _named_streamed(oai, seed), seeds))
    for name, arguments in required + named:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert {name for name, _ in named} == {"add"}
    assert len(set(required)) > 1 and len(set(named)) > 1  # sampled: the draws differ
    cluster.wait_clean()


def test_forced_calls_validate_for_5_seeds(cluster):
    _check_forced_calls(cluster, range(5))


@pytest.mark.benchmark
def test_forced_calls_validate_for_50_seeds(cluster):
    _check_forced_calls(cluster, range(50))
