"""The Responses API through `radixserve up`'s processes (the ``remote`` cluster: gateway,
prefill and decode workers, NIXL, every prompt prefilled remotely; the default model),
with the unmodified OpenAI SDK: a three-turn agent loop on `previous_response_id` (a
question, a streamed forced function call, its result) whose later turns report the
earlier prompts' pages as cached, and whose call's arguments validate against the
tool's schema."""

from __future__ import annotations

import json
import uuid

import jsonschema
import openai

from tests.gateway.test_responses_api import TOOLS

SHARED_CLUSTER = "remote"  # shared with other modules: tests/cluster/conftest.py
PAGE = 16
ADD = TOOLS[1]  # the Responses API's shape of the chat tests' `add`


def test_an_agent_loop_continues_stored_responses_from_the_cache(cluster):
    # instructions new to the shared cluster, so the first turn's prompt is uncached
    common = dict(model="default", temperature=0, tools=[ADD],
                  instructions=f"[{uuid.uuid4().hex[:8]}] You are a terse accountant.")  # fmt: skip
    with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0) as oai:
        first = oai.responses.create(input="I owe 2 euros and 3 euros.", max_output_tokens=3,
                                     **common)  # fmt: skip
        with oai.responses.stream(input=[{"role": "user", "content": "Add them up."}],
                                  previous_response_id=first.id, max_output_tokens=24,
                                  tool_choice={"type": "function", "name": "add"},
                                  **common) as stream:  # fmt: skip
            second = stream.get_final_response()
        (call,) = [item for item in second.output if item.type == "function_call"]
        jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
        third = oai.responses.create(
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
            previous_response_id=second.id, max_output_tokens=3, **common,
        )  # fmt: skip
    for earlier, later in ((first, second), (second, third)):
        assert later.usage.input_tokens > earlier.usage.input_tokens
        cached = later.usage.input_tokens_details.cached_tokens
        assert cached >= earlier.usage.input_tokens // PAGE * PAGE, (earlier.usage, later.usage)
    assert third.status in ("completed", "incomplete") and third.output
