"""The Responses API (`POST /v1/responses`, GET and DELETE of a stored response) through
the unmodified OpenAI SDK against the session's gateway (SmolLM2, in-process engine):
string and item input, a `previous_response_id` chain served from the prefix cache,
streaming events consumed by the SDK's helpers, function tools (the arguments validate
against the schema), `text.format` json_schema, `store: false`, the store's bound, and
unserved fields refused by name."""

from __future__ import annotations

import json
from typing import Any, cast

import jsonschema
import openai
import pytest

from radixserve.runtime.engine_client import EngineClient
from radixserve.services.gateway import GatewaySettings, create_app
from radixserve.services.gateway.responses_api.output import ResponseBuilder
from radixserve.services.gateway.responses_api.store import ResponseStore, Turn
from radixserve.services.gateway.tenancy.tenants import ANONYMOUS
from radixserve.services.gateway.tools.tool_calls import PARSERS
from radixserve.services.gateway.tools.tool_stream import ToolCallStream
from tests.gateway.conftest import RunningServer, assert_openai_error
from tests.gateway.test_tools import ADD, SCHEMAS, WEATHER

# the flat shape of the Responses API
TOOLS = [{"type": "function", **cast(dict[str, Any], t["function"])} for t in (WEATHER, ADD)]
SYSTEM = "You are a terse assistant. Answer in one short sentence. " * 3
FAST = {"model": "default", "temperature": 0, "max_output_tokens": 3}


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _text(response) -> str:
    (message,) = [item for item in response.output if item.type == "message"]
    return message.content[0].text


def test_string_and_item_input_are_the_same_prompt(oai):
    by_string = oai.responses.create(input="Name a colour.", instructions=SYSTEM, **FAST)
    assert by_string.object == "response" and by_string.id.startswith("resp_")
    assert by_string.status in ("completed", "incomplete")
    assert by_string.output_text == _text(by_string) and by_string.output_text
    usage = by_string.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 3
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    items = [{"role": "developer", "content": SYSTEM},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Name a colour."}]}]  # fmt: skip
    by_items = oai.responses.create(input=items, **FAST)
    assert by_items.output_text == by_string.output_text  # greedy, the same prompt
    assert by_items.usage.input_tokens == usage.input_tokens
    assert by_items.usage.input_tokens_details.cached_tokens > 0  # the same prefix again


def test_a_three_turn_chain_is_served_from_the_cache(oai, client):
    page = 16  # the engine's page size: the cache serves whole pages
    first = oai.responses.create(input="Say hello.", instructions=SYSTEM, **FAST)
    prompts = [first.usage.input_tokens]
    previous = first
    for question in ("Now say goodbye.", "And thank me."):
        turn = oai.responses.create(input=[{"role": "user", "content": question}],
                                    previous_response_id=previous.id, instructions=SYSTEM,
                                    **FAST)  # fmt: skip
        assert turn.previous_response_id == previous.id
        # the prompt holds the earlier turn's prompt and reply, so it grows ...
        assert turn.usage.input_tokens > prompts[-1] + previous.usage.output_tokens - 1
        # ... and the earlier prompt's full pages come from the cache
        assert turn.usage.input_tokens_details.cached_tokens >= prompts[-1] // page * page > 0
        prompts.append(turn.usage.input_tokens)
        previous = turn
    assert oai.responses.retrieve(previous.id).output_text == previous.output_text


def test_streamed_events_reassemble_to_the_non_streamed_response(oai):
    args = dict(input="Hi!", model="default", temperature=0, max_output_tokens=16)
    full = oai.responses.create(**args)  # a 10-token greeting: it completes
    assert full.status == "completed"
    with oai.responses.stream(**args) as stream:  # the SDK's helper checks the sequence
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == full.output_text
    assert final.usage.output_tokens == full.usage.output_tokens
    assert oai.responses.retrieve(final.id).output_text == deltas  # stored before completed


def _calls(response) -> list:
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def test_function_tools_required_and_named_validate_and_stream(oai):
    r = oai.responses.create(input="What is 2 plus 3?", tools=TOOLS, tool_choice="required",
                             model="default", temperature=1.0, max_output_tokens=24)  # fmt: skip
    (call,) = _calls(r)
    assert call.name in {"get_weather", "add"} and r.status == "completed"
    args = dict(input="What is 2 plus 3?", tools=TOOLS, model="default", temperature=0,
                tool_choice={"type": "function", "name": "add"}, max_output_tokens=24)  # fmt: skip
    full = oai.responses.create(**args)
    with oai.responses.stream(**args) as stream:
        fragments = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    (call,), (again,) = _calls(full), _calls(streamed)
    assert call.name == again.name == "add" and call.arguments == again.arguments
    assert "".join(fragments) == call.arguments and len(fragments) > 1  # as generated
    # the tool's result continues the stored conversation, whose prompt the cache holds
    follow = oai.responses.create(
        input=[{"type": "function_call_output", "call_id": again.call_id, "output": "5"}],
        previous_response_id=streamed.id,
        tools=TOOLS,
        **FAST,
    )
    assert follow.output_text
    assert follow.usage.input_tokens_details.cached_tokens >= streamed.usage.input_tokens // 16 * 16


def test_text_format_json_schema_validates(oai):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]},
              "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}  # fmt: skip
    r = oai.responses.create(input="A colour and a count, as JSON.", model="default",
                             temperature=1.0, max_output_tokens=40,
                             text={"format": {"type": "json_schema", "name": "pick",
                                              "schema": schema, "strict": True}})  # fmt: skip
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_store_false_get_and_delete(oai, http):
    kept = oai.responses.create(input="Hi.", **FAST)
    assert oai.responses.retrieve(kept.id).id == kept.id
    oai.responses.delete(kept.id)
    for call in (lambda: oai.responses.retrieve(kept.id), lambda: oai.responses.delete(kept.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unkept = oai.responses.create(input="Hi.", store=False, **FAST)
    assert unkept.store is False
    error = assert_openai_error(http.get(f"/v1/responses/{unkept.id}"), 404)
    assert error["param"] == "response_id" and unkept.id in error["message"]
    body = {"input": "Go on.", "previous_response_id": unkept.id, "max_output_tokens": 2}
    error = assert_openai_error(http.post("/v1/responses", json=body), 404)
    assert error["param"] == "previous_response_id"
    error = assert_openai_error(http.get(f"/v1/responses/{kept.id}?stream=true"), 400)
    assert error["param"] == "stream"


def test_input_items_list_a_chain_in_pages(oai, http):
    """`client.responses.input_items.list`: the items a response was made from (the
    conversation it continued, then its input; not its instructions), newest first by
    default, paged with limit and after; an unknown id is a 404 naming it."""
    first = oai.responses.create(input="Say hi.", instructions=SYSTEM, **FAST)
    given = [{"type": "message", "role": "user", "content": "And again.", "id": "msg_mine"}]
    second = oai.responses.create(input=given, previous_response_id=first.id, **FAST)
    items = oai.responses.input_items.list(second.id, order="asc")
    assert [(i.type, getattr(i, "role", None)) for i in items.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")]  # fmt: skip
    assert items.data[0].content[0].text == "Say hi."
    assert items.data[1].id == first.output[0].id
    assert items.data[1].content[0].text == first.output_text
    assert items.data[2].id == "msg_mine" and items.has_more is False
    assert (items.first_id, items.last_id) == (items.data[0].id, "msg_mine")
    newest = oai.responses.input_items.list(second.id, limit=2)
    assert [i.id for i in newest.data] == ["msg_mine", first.output[0].id] and newest.has_more
    rest = oai.responses.input_items.list(second.id, limit=2, after=newest.last_id)
    assert [i.id for i in rest.data] == [items.data[0].id] and not rest.has_more
    paged = [i.id for i in oai.responses.input_items.list(second.id, limit=1, order="asc")]
    assert paged == [i.id for i in items.data]  # the SDK's iterator follows `after`
    with pytest.raises(openai.NotFoundError, match="resp_gone"):
        oai.responses.input_items.list("resp_gone")
    path = f"/v1/responses/{second.id}/input_items"
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=msg_x", "after"),
                         ("include=x", "include")):  # fmt: skip
        assert assert_openai_error(http.get(f"{path}?{query}"), 400)["param"] == param


def test_the_store_evicts_the_oldest_first_and_expires():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10, clock=lambda: now[0])
    first = Turn(({"type": "message", "role": "user", "content": "a"},))
    for name in ("r1", "r2", "r3"):
        store.put(name, {"id": name}, Turn(({"n": name},), first))
    assert len(store) == 2
    with pytest.raises(Exception, match="no stored response 'r1'"):
        store.body("r1", "response_id", ANONYMOUS)
    assert store.body("r2", "response_id", ANONYMOUS) == {"id": "r2"}
    # an evicted turn's items stay reachable from the responses continuing it
    assert store.turn("r3", "p", ANONYMOUS).conversation() == [*first.items, {"n": "r3"}]
    now[0] = 10.5
    assert len(store) == 0
    store = ResponseStore(max_entries=0, ttl_s=10)
    store.put("r", {}, first)
    assert len(store) == 0


def test_the_gateway_store_is_bounded(serve_app):
    running = serve_app(response_store_size=2)
    with openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0) as c:
        ids = [c.responses.create(input=f"Say {n}.", **FAST).id for n in range(3)]
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[0])
        assert [c.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


class FailingClient(EngineClient):
    """The session's engine, but every stream fails after its first output: a stand-in
    for an engine fault mid-stream, which nothing real here produces on demand."""

    def __init__(self, inner: EngineClient) -> None:
        self.inner = inner

    async def generate(self, prompt_ids, params, request_id, **traced):  # type: ignore[override]
        stream = self.inner.generate(prompt_ids, params, request_id, **traced)
        try:
            yield await stream.__anext__()  # type: ignore[attr-defined]
            raise RuntimeError("engine fault")
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    tokenizer = property(lambda self: self.inner.tokenizer)
    model_name = property(lambda self: self.inner.model_name)
    max_model_len = property(lambda self: self.inner.max_model_len)
    stats = property(lambda self: self.inner.stats)

    def close(self) -> None:  # the session's engine stays up
        pass


def test_a_failed_stream_ends_with_error_and_failed_and_is_not_stored(client):
    running = RunningServer(create_app(FailingClient(client), GatewaySettings()))
    try:
        with openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0) as c:
            events = list(c.responses.create(input="Hi!", stream=True, **FAST))
            kinds = [e.type for e in events]
            assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
            assert "engine fault" in events[-2].message
            failed = events[-1].response
            assert failed.status == "failed" and failed.error.code == "server_error"
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(failed.id)
    finally:
        running.stop()


REFUSALS = {  # body fields -> the param the error names
    "web search tool": ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    "file search tool": ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]},
                         "tools[0].type"),
    "code interpreter": ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    "chat-shaped tool": ({"tools": [WEATHER]}, "tools[0].function"),
    "unknown tool field": ({"tools": [{**TOOLS[0], "x": 1}]}, "tools[0].x"),
    "hosted tool_choice": ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}},
                           "tool_choice"),
    "tool_choice not in tools": ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                                 "name": "nope"}}, "tool_choice"),
    "forced with text.format": ({"tools": TOOLS, "tool_choice": "required", "text": {
        "format": {"type": "json_object"}}}, "tool_choice"),
    "background": ({"background": True}, "background"),
    "reasoning effort without a switch": ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    "reasoning summary": ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    "encrypted reasoning": ({"input": [{"type": "reasoning", "summary": [],
                                        "encrypted_content": "x"}]},
                            "input[0].encrypted_content"),
    "include": ({"include": ["reasoning.encrypted_content"]}, "include"),
    "truncation auto": ({"truncation": "auto"}, "truncation"),
    "conversation": ({"conversation": "conv_1"}, "conversation"),
    "prompt template": ({"prompt": {"id": "p"}}, "prompt"),
    "top_logprobs": ({"top_logprobs": 3}, "top_logprobs"),
    "max_tool_calls": ({"max_tool_calls": 2}, "max_tool_calls"),
    "unknown field": ({"frequency_penalty": 1}, "frequency_penalty"),
    "verbosity": ({"text": {"verbosity": "low"}}, "text.verbosity"),
    "schema missing": ({"text": {"format": {"type": "json_schema", "name": "x"}}},
                       "text.format.schema"),
    "schema unenforceable": ({"text": {"format": {"type": "json_schema", "name": "x",
                                                  "schema": {"type": "nonsense"}}}},
                             "text.format.schema"),
    "obfuscation": ({"stream": True, "stream_options": {"include_obfuscation": True}},
                    "stream_options.include_obfuscation"),
    "temperature": ({"temperature": 3}, "temperature"),
    "max_output_tokens": ({"max_output_tokens": 0}, "max_output_tokens"),
    "max_output_tokens over context": ({"max_output_tokens": 10**6}, "max_output_tokens"),
    "input missing": ({"input": None}, "input"),
    "input wrong type": ({"input": 5}, "input"),
    "image part": ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0].type"),
    "bad role": ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    "item reference": ({"input": [{"type": "item_reference", "id": "msg_1"}]},
                       "input[0].type"),
    "output without call": ({"input": [{"type": "function_call_output", "call_id": "c",
                                        "output": "1"}]}, "input[0].call_id"),
    "call without name": ({"input": [{"type": "function_call", "call_id": "c",
                                      "arguments": "{}"}]}, "input[0].name"),
    "input over context": ({"input": "word " * 9000}, "input"),
}  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), REFUSALS.values(), ids=REFUSALS.keys())
def test_unserved_and_bad_fields_are_400_naming_the_field(http, fields, param):
    body = {"input": "Hi.", "max_output_tokens": 2, **fields}
    if body["input"] is None:
        del body["input"]
    error = assert_openai_error(http.post("/v1/responses", json=body), 400)
    assert error["param"] == param, error
    assert error["message"].startswith(param), error
    for raw in ("Input should", "List should", "Value error", "Field required"):
        assert raw not in error["message"], error


def test_a_streamed_call_cut_short_is_an_incomplete_item():
    """Argument fragments stream as `response.function_call_arguments.delta` events; a
    call cut by max_output_tokens mid-arguments ends `incomplete`, as its response."""
    builder = ResponseBuilder({"id": "resp_x", "output": []})
    builder.opening()
    stream = ToolCallStream(PARSERS["json"], {"add"}, single=True, incremental=True)
    events = [e for piece in ('{"name":"add","argu', 'ments":{"a":', "1,") for e in
              builder.feed(stream.feed(piece))]  # fmt: skip
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"a":', "1,"]
    closing = builder.finish("length", {})
    (item,) = builder.body["output"]
    assert item["arguments"] == '{"a":1,' and item["status"] == "incomplete"
    assert closing[-1]["type"] == "response.incomplete"
