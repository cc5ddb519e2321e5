"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) through the
unmodified Anthropic SDK against the session's gateway (SmolLM2, in-process engine):
a reply and its stream (the SDK's accumulator) are the same, stop sequences and
max_tokens end it as Anthropic says, forced tools validate against their schema, a
tool loop, count_tokens equals the usage charged, a conversation's later turns read
the earlier ones from the cache, errors are Anthropic's objects naming the field
(x-api-key included), overload is a 529, and the route is admitted, rate-limited and
traced per tenant as chat is."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from radixserve.services.gateway import GatewaySettings, create_app
from radixserve.services.gateway.messages.output import with_pings
from radixserve.services.gateway.messages.plan import checked_tools
from radixserve.services.gateway.messages.request import MessagesRequest
from radixserve.services.gateway.tools.tool_request import ToolFormat
from tests.gateway.conftest import RunningServer
from tests.gateway.test_reasoning_http import (  # (its fixtures: the thinking checkpoints)
    ANSWER,
    REASONING,
    checkpoints,  # noqa: F401
    engines,  # noqa: F401
    serve,  # noqa: F401
)
from tests.gateway.test_responses_api import FailingClient
from tests.gateway.test_tool_stream import LONG
from tests.gateway.test_tools import ADD, WEATHER

TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
          "input_schema": t["function"]["parameters"]} for t in (WEATHER, ADD)]  # fmt: skip
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
GREEDY = {"extra_body": {"temperature": 0}}  # (the SDK takes sampling fields as extra_body)
ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error",
               "not_found_error", "request_too_large", "rate_limit_error", "api_error",
               "overloaded_error", "timeout_error"}  # fmt: skip


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as c:
        yield c


def _ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _blocks(message) -> list[dict[str, Any]]:
    """The content as plain blocks, tool_use ids left out (each reply draws new ones)."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"}
            for b in message.content]  # fmt: skip


def _prompt(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    """The response has `status` and Anthropic's error object of type `kind`; its message."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    message: str = body["error"]["message"]
    assert message
    return message


def test_a_reply_and_its_stream_are_the_same(claude):
    args = dict(model="default", max_tokens=16, system="You are terse.",
                messages=_ask("Name three colours."), **GREEDY)  # fmt: skip
    reply = claude.messages.create(**args)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    assert 0 < reply.usage.output_tokens <= 16
    with claude.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert _blocks(final) == _blocks(reply)  # greedy: the same reply, block for block
    assert (final.stop_reason, final.usage.output_tokens) == (reply.stop_reason,
                                                              reply.usage.output_tokens)  # fmt: skip
    assert _prompt(final.usage) == _prompt(reply.usage)
    # the same prompt again: all but its last token (never served from the cache) in pages
    assert final.usage.cache_read_input_tokens >= (_prompt(reply.usage) - 1) // 16 * 16 > 0


def test_the_raw_event_sequence(http):
    body = {"model": "default", "max_tokens": 4, "stream": True, "messages": _ask("Hi."),
            "temperature": 0}  # fmt: skip
    with http.stream("POST", "/v1/messages", json=body,
                     headers={"anthropic-version": "2023-06-01"}) as response:  # fmt: skip
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert set(start["usage"]) == {"input_tokens", "cache_creation_input_tokens",
                                   "cache_read_input_tokens", "output_tokens"}  # fmt: skip
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4


def test_pings_fill_idle_gaps():
    """`with_pings` yields None (a ping) after each idle interval and the items as they
    come; the source here waits for the ping before its item, so one must arrive."""

    async def run() -> list[Any]:
        pinged = asyncio.Event()

        async def source():
            await pinged.wait()
            yield "item"

        seen: list[Any] = []
        async for item in with_pings(source(), 0.01):
            seen.append(item)
            if item is None:
                pinged.set()
        return seen

    seen = asyncio.run(run())
    assert seen[-1] == "item" and None in seen and set(seen[:-1]) == {None}


def test_stop_sequences_end_the_reply_on_the_first_one_met(claude):
    args = dict(model="default", max_tokens=24, messages=_ask("Describe the sea."), **GREEDY)
    free = claude.messages.create(**args).content[0].text
    words = free.split()
    assert len(words) >= 4, free
    stop = f" {words[2]}"  # a stop string the greedy reply meets at its third word
    cut = claude.messages.create(stop_sequences=["never-said-xyz", stop], **args)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == free[: free.index(stop)]
    with claude.messages.stream(stop_sequences=[stop], **args) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert streamed.content[0].text == cut.content[0].text
    capped = claude.messages.create(**{**args, "max_tokens": 3})
    assert (capped.stop_reason, capped.usage.output_tokens) == ("max_tokens", 3)


def test_forced_tools_validate_against_their_input_schema(claude):
    """tool_choice "tool" and "any" are grammar-enforced: seeded sampled replies
    (temperature 1; ``seed`` is radixserve's extension) each hold one tool_use whose
    input validates; a seed gives the same reply again. (20 of them run through a
    cluster: tests/cluster/test_messages_cluster.py.)"""
    names = []
    for run in range(8):
        choice = {"type": "tool", "name": "get_weather"} if run % 2 else {"type": "any"}
        reply = claude.messages.create(
            model="default", max_tokens=64, tools=TOOLS, tool_choice=choice,
            messages=_ask(f"Question {run}: the weather in Paris, or 2 plus {run}?"),
            extra_body={"temperature": 1.0, "seed": run},
        )  # fmt: skip
        if run == 3:
            again = claude.messages.create(
                model="default", max_tokens=64, tools=TOOLS, tool_choice=choice,
                messages=_ask(f"Question {run}: the weather in Paris, or 2 plus {run}?"),
                extra_body={"temperature": 1.0, "seed": run},
            )  # fmt: skip
            assert _blocks(again) == _blocks(reply)
        assert reply.stop_reason == "tool_use", reply
        (block,) = reply.content
        assert block.type == "tool_use" and block.id
        jsonschema.validate(block.input, SCHEMAS[block.name])
        if run % 2:
            assert block.name == "get_weather"
        names.append(block.name)
    assert set(names) <= set(SCHEMAS)


def test_tool_choice_is_the_chat_paths():
    """any -> required, tool -> the named function, none -> no tools rendered, and
    disable_parallel_tool_use -> at most one call returned."""
    limits = GatewaySettings().prepare_limits()

    def tools(choice: dict[str, Any]):
        body = {"model": "default", "max_tokens": 1, "messages": _ask("Hi."), "tools": TOOLS,
                "tool_choice": choice}  # fmt: skip
        return checked_tools(MessagesRequest.checked(body), limits)

    plain = ToolFormat(native=False, parser="hermes")
    auto = tools({"type": "auto"})
    assert (auto.choice, auto.plan(plain).single) == ("auto", False)
    assert tools({"type": "auto", "disable_parallel_tool_use": True}).plan(plain).single
    assert tools({"type": "any"}).choice == "required"
    assert tools({"type": "tool", "name": "add"}).choice == "add"
    assert tools({"type": "none"}) is None


def test_a_tool_loop_answers_after_the_result(claude):
    common = dict(model="default", tools=TOOLS, system="You are a terse accountant.", **GREEDY)
    question = _ask("I owe 2 euros and 3 euros. Add them up.")
    with claude.messages.stream(max_tokens=48, tool_choice={"type": "tool", "name": "add"},
                                messages=question, **common) as stream:  # fmt: skip
        partials = [e.partial_json for e in stream if e.type == "input_json"]
        call = stream.get_final_message()
    assert call.stop_reason == "tool_use"
    (use,) = call.content
    assert use.type == "tool_use" and use.name == "add" and len(partials) > 1
    jsonschema.validate(use.input, SCHEMAS["add"])
    assert json.loads("".join(partials)) == use.input  # streamed as generated
    answer_to = [*question, {"role": "assistant", "content": call.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": [{"type": "text", "text": "5"}]}]}]  # fmt: skip
    answer = claude.messages.create(max_tokens=8, messages=answer_to, **common)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.content
    # the second prompt begins with the first: its whole pages come from the cache
    assert answer.usage.cache_read_input_tokens >= _prompt(call.usage) // 16 * 16 > 0
    counted = claude.messages.count_tokens(model="default", messages=answer_to,
                                           tools=TOOLS, system=common["system"])  # fmt: skip
    assert counted.input_tokens == _prompt(answer.usage)


def test_count_tokens_is_the_prompt_charged(claude, http):
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "The user wants weather.", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Oslo", "unit": "celsius"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "-3", "is_error": False},
                                     {"type": "text", "text": "Dress how?"}]},
    ]  # fmt: skip
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    for body in ({"messages": _ask("Hello there.")},
                 {"messages": history, "system": system, "tools": TOOLS},
                 {"messages": history, "tools": TOOLS, "tool_choice": {"type": "none"}}):  # fmt: skip
        counted = claude.messages.count_tokens(model="default", **body).input_tokens
        reply = claude.messages.create(model="default", max_tokens=2, **body, **GREEDY)
        assert counted == _prompt(reply.usage) > 0, body
    # thinking blocks of earlier turns are dropped, as templates drop them
    without = [history[0], {**history[1], "content": history[1]["content"][1:]}, history[2]]
    dropped = claude.messages.count_tokens(model="default", messages=without).input_tokens
    assert dropped == claude.messages.count_tokens(model="default", messages=history).input_tokens
    # tool_choice none renders no tools: a smaller prompt
    with_tools = claude.messages.count_tokens(model="default", messages=history, tools=TOOLS)
    no_tools = claude.messages.count_tokens(model="default", messages=history, tools=TOOLS,
                                            tool_choice={"type": "none"})  # fmt: skip
    assert no_tools.input_tokens < with_tools.input_tokens


def test_a_conversation_reads_its_earlier_turns_from_the_cache(claude, client):
    page = client.cache_page_size
    assert page > 0
    system = f"[{uuid.uuid4().hex}] You are a terse assistant."  # a prefix new to the cache
    messages: list[dict[str, Any]] = []
    earlier = None
    for question in ("Say hello.", "Now say goodbye.", "And thank me."):
        messages.append({"role": "user", "content": question})
        reply = claude.messages.create(model="default", max_tokens=4, system=system,
                                       messages=messages, **GREEDY)  # fmt: skip
        usage = reply.usage
        prompt = _prompt(usage)
        if earlier is None:  # nothing cached: its whole pages are computed and kept
            assert usage.cache_read_input_tokens == 0
            assert usage.cache_creation_input_tokens == prompt // page * page
        else:
            assert prompt > _prompt(earlier)
            assert usage.cache_read_input_tokens >= _prompt(earlier) // page * page
        assert usage.input_tokens < page  # the rest: the last partial page
        messages.append({"role": "assistant", "content": reply.content[0].text})
        earlier = usage


REFUSALS = {  # body fields -> the field the error names
    "unknown field": ({"frequency_penalty": 1}, "frequency_penalty"),
    "max_tokens missing": ({"max_tokens": None}, "max_tokens"),
    "max_tokens zero": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens over context": ({"max_tokens": 10**6}, "max_tokens"),
    "temperature": ({"temperature": 1.5}, "temperature"),
    "thinking on a model that does not think": ({"thinking": {"type": "enabled",
                                                              "budget_tokens": 2048}},
                                                 "thinking"),
    "thinking without a budget": ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    "thinking budget": ({"thinking": {"type": "enabled", "budget_tokens": 10}},
                        "thinking.budget_tokens"),
    "thinking budget without enabled": ({"thinking": {"type": "disabled",
                                                      "budget_tokens": 2048}},
                                        "thinking.budget_tokens"),
    "thinking display": ({"thinking": {"type": "adaptive", "display": "full"}},
                         "thinking.display"),
    "mcp servers": ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]},
                    "mcp_servers"),
    "container": ({"container": "c1"}, "container"),
    "image block": ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
        "messages[0].content[0].type"),
    "tool_use in a user turn": ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "add", "input": {}}]}]},
        "messages[0].content[0].type"),
    "unknown block field": ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "citations": []}]}]},
        "messages[0].content[0].citations"),
    "result without a call": ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]},
        "messages[0].content[0].tool_use_id"),
    "bad role": ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    "final assistant turn": ({"messages": [*_ask("Hi."), {"role": "assistant",
                                                          "content": "Hel"}]}, "messages[1].role"),
    "server tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                    "tools[0].type"),
    "tool without schema": ({"tools": [{"name": "add"}]}, "tools[0].input_schema"),
    "tool name": ({"tools": [{**TOOLS[1], "name": "a b"}]}, "tools[0].name"),
    "tool field": ({"tools": [{**TOOLS[1], "defer_loading": True}]}, "tools[0].defer_loading"),
    "strict with auto": ({"tools": [{**TOOLS[1], "strict": True}]}, "tools[0].strict"),
    "unenforceable schema": ({"tools": [{**TOOLS[1], "input_schema": {"type": "nonsense"}}],
                              "tool_choice": {"type": "any"}}, "tools[0].input_schema"),
    "tool_choice unknown tool": ({"tools": TOOLS, "tool_choice": {"type": "tool",
                                                                  "name": "nope"}},
                                 "tool_choice.name"),
    "tool_choice tool without name": ({"tools": TOOLS, "tool_choice": {"type": "tool"}},
                                      "tool_choice.name"),
    "tool_choice type": ({"tools": TOOLS, "tool_choice": {"type": "required"}},
                         "tool_choice.type"),
    "stop_sequences": ({"stop_sequences": [""]}, "stop_sequences[0]"),
    "metadata field": ({"metadata": {"user_id": "u", "x": 1}}, "metadata.x"),
    "prompt over context": ({"messages": _ask("word " * 9000)}, "messages"),
}  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), REFUSALS.values(), ids=REFUSALS.keys())
def test_bad_and_unserved_fields_are_anthropic_400s_naming_the_field(http, fields, param):
    body = {"model": "default", "max_tokens": 2, "messages": _ask("Hi."), **fields}
    body = {k: v for k, v in body.items() if v is not None}
    message = assert_anthropic_error(http.post("/v1/messages", json=body), 400,
                                     "invalid_request_error")  # fmt: skip
    assert message.startswith(param), message
    for raw in ("Input should", "List should", "Value error", "Field required"):
        assert raw not in message, message


def test_count_tokens_refusals_and_unknown_model(claude, http):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens is not a field"):
        claude.messages.count_tokens(model="default", messages=_ask("Hi."),
                                     extra_body={"max_tokens": 3})  # fmt: skip
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-nope", max_tokens=2, messages=_ask("Hi."))
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    message = assert_anthropic_error(http.post("/v1/messages", content=b"{"), 400,
                                     "invalid_request_error")  # fmt: skip
    assert "not valid JSON" in message
    accepted = claude.messages.create(
        model="default", max_tokens=2, messages=_ask("Hi."), metadata={"user_id": "u-1"},
        thinking={"type": "disabled"}, service_tier="auto", **GREEDY,
    )  # fmt: skip
    assert accepted.usage.output_tokens == 2


def test_x_api_key_is_the_api_key(serve_app):
    running = serve_app(api_keys=["sk-messages-test-0123456789"])
    with anthropic.Anthropic(base_url=running.url, api_key="sk-wrong-key-0123456789",
                             max_retries=0) as wrong:  # fmt: skip
        with pytest.raises(anthropic.AuthenticationError) as refused:
            wrong.messages.create(model="default", max_tokens=2, messages=_ask("Hi."))
        assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    body = {"model": "default", "max_tokens": 2, "messages": _ask("Hi.")}
    assert_anthropic_error(httpx.post(f"{running.url}/v1/messages/count_tokens", json=body),
                           401, "authentication_error")  # fmt: skip
    with anthropic.Anthropic(base_url=running.url, api_key="sk-messages-test-0123456789",
                             max_retries=0) as right:  # fmt: skip
        assert right.messages.create(**body).usage.output_tokens >= 1  # type: ignore[arg-type]
    bearer = {"Authorization": "Bearer sk-messages-test-0123456789"}
    served = httpx.post(f"{running.url}/v1/messages", json=body, headers=bearer, timeout=60)
    assert served.status_code == 200, served.text


def test_overload_is_a_529_and_rates_a_429(tiny_gateway):
    key, limited = "sk-messages-acme-0123456789", "sk-messages-rpm-0123456789"
    _, http = tiny_gateway(max_queued_requests=1, trace_buffer=4, api_keys=[
        {"key": key, "tenant": "acme", "role": "admin"},
        {"key": limited, "tenant": "rpm", "requests_per_minute": 1}])  # fmt: skip
    body = {"model": "default", "max_tokens": 2, "messages": _ask("Count.")}
    long = {**body, "max_tokens": 400, "stream": True}
    with http.stream("POST", "/v1/messages", json=long, headers={"x-api-key": key}) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: dropping the iterator closes the response
        assert next(lines) == "event: message_start"
        refused = http.post("/v1/messages", json=body, headers={"x-api-key": key})
        message = assert_anthropic_error(refused, 529, "overloaded_error")
        assert "tenant acme is over its share" in message  # of max_queued_requests 1
        assert int(refused.headers["retry-after"]) >= 1
    deadline = time.monotonic() + 30  # the held stream's slot comes back once it is gone
    while http.get("/debug/cache", headers={"x-api-key": key}).json()["gateway_in_flight"]:
        assert time.monotonic() < deadline, "the held stream was not released"
        time.sleep(0.05)
    served = http.post("/v1/messages", json=body, headers={"x-api-key": key})
    assert served.status_code == 200, served.text
    traced = served.headers["traceparent"].split("-")[1]
    traces = http.get("/debug/traces", headers={"x-api-key": key}).json()["traces"]
    assert [t["request_id"] for t in traces if t["trace_id"] == traced] == [served.json()["id"]]
    first = http.post("/v1/messages", json=body, headers={"x-api-key": limited})
    assert first.status_code == 200, first.text
    again = http.post("/v1/messages", json=body, headers={"x-api-key": limited})
    assert "requests_per_minute" in assert_anthropic_error(again, 429, "rate_limit_error")
    metrics = http.get("/metrics").text
    assert 'refused_requests_total{reason="tenant_share"} 1.0' in metrics
    assert 'refused_requests_total{reason="requests_per_minute"} 1.0' in metrics


def test_a_failed_stream_ends_with_an_error_event(client):
    running = RunningServer(create_app(FailingClient(client), GatewaySettings()))
    try:
        body = {"model": "default", "max_tokens": 8, "messages": _ask("Hi!"), "stream": True}
        text = httpx.post(f"{running.url}/v1/messages", json=body, timeout=60).text
        name, data = text.strip().split("\n\n")[-1].split("\n")
        assert name == "event: error"
        error = json.loads(data.removeprefix("data: "))
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert "engine fault" in error["error"]["message"]
        with (
            anthropic.Anthropic(base_url=running.url, api_key="x", max_retries=0) as c,
            pytest.raises(anthropic.APIStatusError, match="engine fault"),
            c.messages.stream(model="default", max_tokens=8, messages=_ask("Hi!")) as stream,
        ):
            stream.get_final_message()
    finally:
        running.stop()


def test_thinking_models_reply_with_thinking_blocks(serve):  # noqa: F811 (the fixture)
    """The tiny thinking checkpoints of test_reasoning_http (greedy: ``<think>Hello
    world</think>The answer``): Qwen3's template takes thinking on and off (its
    enable_thinking switch), a thinking block sent back reaches it as reasoning_content;
    R1's, without a switch, always thinks."""
    running, _ = serve("qwen3")
    enabled = {"type": "enabled", "budget_tokens": 1024}
    with anthropic.Anthropic(base_url=running.url, api_key="x", max_retries=0) as claude:
        args = dict(model="default", max_tokens=32, messages=_ask("Hi"), **GREEDY)
        reply = claude.messages.create(thinking=enabled, **args)  # type: ignore[arg-type]
        assert [b.type for b in reply.content] == ["thinking", "text"]
        assert (reply.content[0].thinking, reply.content[1].text) == (REASONING, ANSWER)
        assert reply.stop_reason == "end_turn"
        with claude.messages.stream(thinking=enabled, **args) as stream:  # type: ignore[arg-type]
            thoughts = [e.thinking for e in stream if e.type == "thinking"]
            final = stream.get_final_message()
        assert "".join(thoughts) == REASONING and len(thoughts) > 1
        assert _blocks(final) == _blocks(reply)

        def count(messages, **fields) -> int:
            return claude.messages.count_tokens(model="default", messages=messages,
                                                **fields).input_tokens  # fmt: skip

        on = count(_ask("Hi"), thinking=enabled)
        assert on == _prompt(reply.usage) == count(_ask("Hi"))
        assert count(_ask("Hi"), thinking={"type": "disabled"}) == on + 6  # <think>\n\n</think>\n\n
        use = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}
        turn = [{"type": "thinking", "thinking": REASONING, "signature": ""},
                {"type": "text", "text": ANSWER}, use]  # fmt: skip
        result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                               "content": "3"}]}  # fmt: skip
        kept = count([*_ask("Hi"), {"role": "assistant", "content": turn}, result])
        dropped = count([*_ask("Hi"), {"role": "assistant", "content": turn[1:]}, result])
        assert kept > dropped  # Qwen3 renders the thinking of a turn after the last question
    running, _ = serve("r1")
    with anthropic.Anthropic(base_url=running.url, api_key="x", max_retries=0) as claude:
        with pytest.raises(anthropic.BadRequestError, match="always thinks"):
            claude.messages.create(thinking={"type": "disabled"}, **args)  # type: ignore[arg-type]
        reply = claude.messages.create(thinking=enabled, **args)  # type: ignore[arg-type]
        assert [(b.type, getattr(b, "thinking", getattr(b, "text", None))) for b in reply.content
                ] == [("thinking", REASONING), ("text", ANSWER)]  # fmt: skip


def _stream_events(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of a raw streamed reply's events."""
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        text = response.read().decode()
    return [json.loads(chunk.split("\n")[1].removeprefix("data: "))
            for chunk in text.strip().split("\n\n")]  # fmt: skip


def test_budget_tokens_caps_the_thinking(serve):  # noqa: F811 (the fixture)
    """The looping checkpoint reasons ``Hello world`` until its ``</think>`` is written:
    with budget_tokens the engine writes it after that many reasoning tokens, and the
    model answers; streamed and not, thinking shown or omitted."""
    running, http = serve("loop")
    body: dict[str, Any] = {"model": "default", "max_tokens": 1100, "messages": _ask("Hi")}
    enabled = {"type": "enabled", "budget_tokens": 1024}
    with anthropic.Anthropic(base_url=running.url, api_key="x", max_retries=0) as claude:
        reply = claude.messages.create(thinking=enabled, **body, **GREEDY)  # type: ignore[arg-type]
        assert [(b.type, getattr(b, "thinking", getattr(b, "text", None))) for b in reply.content
                ] == [("thinking", REASONING * 512), ("text", ANSWER)]  # fmt: skip
        assert reply.stop_reason == "end_turn"
        # <think>, 1,024 reasoning tokens, </think>, The, answer (and the EOS)
        assert reply.usage.output_tokens in (1024 + 4, 1024 + 5)
        # a budget max_tokens never reaches cannot bind: accepted, the reply all thinking
        eight = {**body, "max_tokens": 8, **GREEDY}
        short = claude.messages.create(thinking=enabled, **eight)  # type: ignore[arg-type]
        assert [b.type for b in short.content] == ["thinking"]
        assert short.stop_reason == "max_tokens"
    events = _stream_events(http, {**body, "temperature": 0,
                                   "thinking": {**enabled, "display": "omitted"}})  # fmt: skip
    blocks = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert blocks == [{"type": "thinking", "thinking": "", "signature": ""},
                      {"type": "text", "text": ""}]  # fmt: skip
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert {e["index"] for e in deltas} == {1}  # no thinking_delta
    assert "".join(e["delta"]["text"] for e in deltas) == ANSWER
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1]
    done = next(e for e in events if e["type"] == "message_delta")
    assert done["usage"]["output_tokens"] == reply.usage.output_tokens


def test_thinking_display(serve):  # noqa: F811 (the fixture)
    """display omitted: the thinking block is there, its text empty (streamed: it opens
    and closes with no thinking_delta); summarized (the default) is the whole reasoning."""
    running, _ = serve("qwen3")
    args = dict(model="default", max_tokens=32, messages=_ask("Hi"), **GREEDY)
    with anthropic.Anthropic(base_url=running.url, api_key="x", max_retries=0) as claude:
        for display, thought in (("omitted", ""), ("summarized", REASONING)):
            thinking = {"type": "enabled", "budget_tokens": 1024, "display": display}
            reply = claude.messages.create(thinking=thinking, **args)  # type: ignore[arg-type]
            assert _blocks(reply) == [{"type": "thinking", "thinking": thought, "signature": ""},
                                      {"type": "text", "text": ANSWER}]  # fmt: skip
            with claude.messages.stream(thinking=thinking, **args) as stream:  # type: ignore[arg-type]
                kinds = [e.type for e in stream]
                final = stream.get_final_message()
            assert _blocks(final) == _blocks(reply)
            assert ("thinking" in kinds) == bool(thought)  # the SDK's thinking_delta events
        forced = {"tools": TOOLS, "tool_choice": {"type": "any"}}
        thinking = {"type": "enabled", "budget_tokens": 1024}
        with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
            claude.messages.create(thinking=thinking, **forced, **args)  # type: ignore[arg-type]


def test_a_streamed_tool_use_the_parser_rejects_ends_with_an_error_event(http):
    """A forced call cut by max_tokens: its tool_use block opened and its input streamed,
    then the stream ends with an error event saying why, never with a stop reason (and
    no ``tool_use``) that would present the cut call as finished."""
    note = {"name": "note", "input_schema": LONG["function"]["parameters"]}
    events = _stream_events(http, {
        "model": "default", "max_tokens": 24, "messages": _ask("Take a note."),
        "tools": [note], "tool_choice": {"type": "tool", "name": "note"}, "temperature": 0,
    })  # fmt: skip
    types = [e["type"] for e in events]
    assert types[-1] == "error" and "message_delta" not in types, types
    assert "cut short" in events[-1]["error"]["message"]
    assert events[-1]["error"]["type"] == "api_error"
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert deltas and all(d["type"] == "input_json_delta" for d in deltas)
