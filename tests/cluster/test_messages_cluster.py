"""Anthropic's Messages API through `radixserve up`'s processes (the ``remote`` cluster:
gateway, prefill and decode workers, NIXL, every prompt prefilled remotely; the default
model), with the unmodified Anthropic SDK: a streamed reply equal to the non-streamed
one, a tool loop (a streamed forced tool_use, its tool_result, the answer) whose input
validates against the tool's schema, count_tokens equal to the usage charged, a second
turn that reads the first turn's pages from the cache, 20 seeded sampled forced calls
whose inputs validate, and a reply ended by one of its ``stop_sequences``."""

from __future__ import annotations

import json
import uuid

import anthropic
import jsonschema

from tests.gateway.test_messages_api import SCHEMAS, TOOLS

SHARED_CLUSTER = "remote"  # shared with other modules: tests/cluster/conftest.py
PAGE = 16
GREEDY = {"extra_body": {"temperature": 0}}


def _prompt(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_messages_stream_tool_loop_and_cache_on_a_cluster(cluster):
    # a system prompt new to the shared cluster, so the first turn's prompt is uncached
    common = dict(model="default", tools=TOOLS,
                  system=f"[{uuid.uuid4().hex[:8]}] You are a terse accountant.")  # fmt: skip
    ask = [{"role": "user", "content": "I owe 2 euros and 3 euros. Add them up."}]
    with anthropic.Anthropic(base_url=cluster.url, api_key="x", max_retries=0) as claude:
        first = claude.messages.create(max_tokens=4, messages=ask, **common, **GREEDY)
        assert first.usage.cache_read_input_tokens == 0
        assert first.usage.cache_creation_input_tokens == _prompt(first.usage) // PAGE * PAGE
        with claude.messages.stream(max_tokens=4, messages=ask, **common, **GREEDY) as stream:
            again = stream.get_final_message()
        assert [b.model_dump(exclude_none=True) for b in again.content] == [
            b.model_dump(exclude_none=True) for b in first.content]  # fmt: skip
        # the same prompt: all but its last token (the cache never serves it) in pages
        assert again.usage.cache_read_input_tokens >= (_prompt(first.usage) - 1) // PAGE * PAGE
        with claude.messages.stream(max_tokens=48, messages=ask, **common, **GREEDY,
                                    tool_choice={"type": "tool", "name": "add"}) as stream:  # fmt: skip
            partials = [e.partial_json for e in stream if e.type == "input_json"]
            call = stream.get_final_message()
        (use,) = call.content
        assert call.stop_reason == "tool_use" and use.name == "add"
        jsonschema.validate(use.input, SCHEMAS["add"])
        assert json.loads("".join(partials)) == use.input
        loop = [*ask, {"role": "assistant", "content": call.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "5"}]}]  # fmt: skip
        counted = claude.messages.count_tokens(messages=loop, **common)
        answer = claude.messages.create(max_tokens=4, messages=loop, **common, **GREEDY)
    assert answer.content and counted.input_tokens == _prompt(answer.usage)
    assert answer.usage.cache_read_input_tokens >= _prompt(call.usage) // PAGE * PAGE


def test_messages_forced_calls_and_stop_sequences_on_a_cluster(cluster):
    ask = [{"role": "user", "content": "The weather in Paris, or 2 plus 3?"}]
    with anthropic.Anthropic(base_url=cluster.url, api_key="x", max_retries=0) as claude:
        for run in range(20):
            choice = {"type": "tool", "name": "get_weather"} if run % 2 else {"type": "any"}
            reply = claude.messages.create(model="default", max_tokens=48, tools=TOOLS,
                                           tool_choice=choice, messages=ask,
                                           extra_body={"temperature": 1.0, "seed": run})  # fmt: skip
            (use,) = reply.content
            assert reply.stop_reason == "tool_use" and use.type == "tool_use"
            jsonschema.validate(use.input, SCHEMAS[use.name])
        free = claude.messages.create(model="default", max_tokens=16, messages=ask, **GREEDY)
        words = free.content[0].text.split()
        assert len(words) >= 3, free  # a stop string met in the middle of the reply
        stopped = claude.messages.create(model="default", max_tokens=16, messages=ask,
                                         stop_sequences=["\u2603", words[2]], **GREEDY)  # fmt: skip
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == words[2]
    assert words[2] not in stopped.content[0].text
