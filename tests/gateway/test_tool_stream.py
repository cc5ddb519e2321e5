"""Tool calls streamed as they are generated, in every format the gateway parses: the
splitter fed a reply in small pieces (no engine), calls the parser rejects after they
opened, the Responses API's items for them, and the streams through HTTP (the tiny
model, its replies forced by a grammar) for chat completions and the Responses API."""

from __future__ import annotations

import json
import random
from typing import Any

import openai
import pytest

from radixserve.services.gateway.responses_api.output import ResponseBuilder
from radixserve.services.gateway.tools.call_scanner import CallScanner
from radixserve.services.gateway.tools.tool_calls import PARSERS
from radixserve.services.gateway.tools.tool_stream import ToolCallStream, split_message

NAMES = ("get_weather", "add")
# a 200+ character arguments object with what a scanner must follow: nesting, braces
# and brackets and quotes inside strings, escapes, unicode
ARGS = json.dumps({
    "city": "Rio de Janeiro", "days": [1, 2, {"x": "}\"]{["}],
    "note": "a \\ backslash, a \"quote\", {braces} and [brackets] inside a string; "
            "unicode: 你好 😀 — and a long tail to pass two hundred characters",
    "nested": {"deep": {"deeper": [True, False, None, 1.5e3]}},
}, ensure_ascii=False)  # fmt: skip
assert len(ARGS) >= 200

FORMATS = {  # name: (parser, reply); each reply's one call has ARGS as its arguments
    "hermes": ("hermes", f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": '
               f"{ARGS}}}\n</tool_call>"),
    "json (forced)": ("json", f'{{"name":"get_weather","arguments":{ARGS}}}'),
    "llama3 python_tag": ("llama3_json", f'<|python_tag|>{{"name": "get_weather", '
                          f'"parameters": {ARGS}}}'),
    "llama3 plain JSON": ("llama3_json", f'{{"name": "get_weather", "parameters": {ARGS}}}'),
    "mistral array": ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}}}]'),
    "mistral array, marker dropped": ("mistral", f'[{{"name": "get_weather", "arguments": '
                                      f"{ARGS}}}]"),
    "mistral v11": ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{ARGS}"),
    "mistral v11 with a call id": ("mistral", f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e"
                                   f"[ARGS] {ARGS}"),
}  # fmt: skip


def _pieces(text: str, seed: int) -> list[str]:
    """`text` in pieces of 1 to 6 characters, as a model's tokens come."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i : i + n])
        i += n
    return out


def _arguments(deltas: list[dict]) -> list[str]:
    """The argument fragments in `deltas` (not the calls' openings)."""
    return [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", ())
            if "id" not in tc and tc["function"]["arguments"]]  # fmt: skip


def _whole(parser: str, text: str) -> list[dict]:
    return split_message(ToolCallStream(PARSERS[parser], NAMES), text)[1]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("parser", "text"), FORMATS.values(), ids=FORMATS.keys())
def test_every_format_streams_its_arguments_as_they_are_written(parser, text, seed):
    """Fed in pieces of a few characters, a call's arguments leave in many fragments
    before the reply ends, adding up to the whole reply's arguments."""
    stream = ToolCallStream(PARSERS[parser], NAMES, incremental=True)
    while_generating = [d for piece in _pieces(text, seed) for d in stream.feed(piece)]
    fragments = _arguments(while_generating)
    assert len(fragments) >= 5
    assert "".join(fragments) == ARGS
    assert _arguments(stream.finish()) == [] and stream.complete and stream.error is None
    (whole,) = _whole(parser, text)
    assert whole["function"] == {"name": "get_weather", "arguments": ARGS}
    assert [c["function"] for c in stream.calls] == [whole["function"]]


NAME_LAST = {  # the arguments before the name: held until the name is known
    "hermes": ("hermes", f'<tool_call>{{"arguments": {ARGS}, "name": "get_weather"}}</tool_call>'),
    "json": ("json", f'{{"arguments":{ARGS},"name":"get_weather"}}'),
    "llama3_json": ("llama3_json", f'{{"parameters": {ARGS}, "name": "get_weather"}}'),
    "mistral array": ("mistral", f'[TOOL_CALLS][{{"arguments": {ARGS}, "name": "get_weather"}}]'),
}  # fmt: skip


@pytest.mark.parametrize(("parser", "text"), NAME_LAST.values(), ids=NAME_LAST.keys())
def test_arguments_before_the_name_go_out_once_the_name_is_known(parser, text):
    stream = ToolCallStream(PARSERS[parser], NAMES, incremental=True)
    named_at = text.index('"get_weather"') + len('"get_weather"')
    assert stream.feed(text[: named_at - 1]) == []  # the name's string has not ended
    opening, arguments = stream.feed(text[named_at - 1 : named_at])
    assert opening["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert _arguments([arguments]) == [ARGS]
    assert stream.feed(text[named_at:]) == [] and stream.finish() == [] and stream.complete
    assert _whole(parser, text)[0]["function"]["arguments"] == ARGS


def test_several_calls_stream_one_after_the_other_in_each_format():
    small = '{"a": 1, "b": {"c": "}"}}'
    texts = {
        "hermes": f'<tool_call>{{"name": "add", "arguments": {small}}}</tool_call> and '
                  f'<tool_call>{{"name": "get_weather", "arguments": {ARGS}}}</tool_call>',
        "llama3_json": f'<|python_tag|>{{"name": "add", "parameters": {small}}}; '
                       f'{{"name": "get_weather", "parameters": {ARGS}}}',
        "mistral": f'[TOOL_CALLS][{{"name": "add", "arguments": {small}}}, '
                   f'{{"name": "get_weather", "arguments": {ARGS}}}]',
    }  # fmt: skip
    texts["mistral v11"] = f"[TOOL_CALLS]add[ARGS]{small}[TOOL_CALLS]get_weather[ARGS]{ARGS}"
    for name, text in texts.items():
        parser = name.split()[0]
        stream = ToolCallStream(PARSERS[parser], NAMES, incremental=True)
        deltas = [d for piece in _pieces(text, 7) for d in stream.feed(piece)]
        opened = [tc for d in deltas for tc in d.get("tool_calls", ()) if "id" in tc]
        assert [tc["index"] for tc in opened] == [0, 1], name
        by_call = ["".join(tc["function"]["arguments"] for d in deltas
                           for tc in d.get("tool_calls", ()) if tc["index"] == i)
                   for i in (0, 1)]  # fmt: skip
        assert by_call == [small, ARGS], name
        stream.finish()
        assert stream.complete, name
        whole = [c["function"]["arguments"] for c in _whole(parser, text)]
        assert whole == [small, ARGS], name


def test_arguments_given_as_a_json_string_go_out_once_it_ends():
    text = f'<tool_call>{{"name": "add", "arguments": {json.dumps(ARGS)}}}</tool_call>'
    stream = ToolCallStream(PARSERS["hermes"], NAMES, incremental=True)
    end = text.index("}</tool_call>")
    assert stream.feed(text[: end - 1]) == []  # the string has not ended
    deltas = stream.feed(text[end - 1 :])
    assert _arguments(deltas) == [ARGS] and deltas[0]["tool_calls"][0]["id"]
    assert stream.finish() == [] and stream.complete
    assert _whole("hermes", text)[0]["function"]["arguments"] == ARGS


REJECTED = {  # name: (parser, reply, what `error` says); each opens a call first
    "malformed JSON after the call opened": (
        "hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b" 2}}</tool_call>',
        "malformed"),
    "malformed text after the call's object": (
        "mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}} {"b"]', "malformed"),
    "cut by max_tokens": ("json", '{"name": "add", "arguments": {"a": 1, "b', "cut short"),
    "mistral v11 cut by max_tokens": ("mistral", '[TOOL_CALLS]add[ARGS]{"a": [1, 2', "cut short"),
    "a later call of an unknown tool": (
        "llama3_json", '{"name": "add", "parameters": {"a": 1}}; '
        '{"name": "rm_rf", "parameters": {}}', "'rm_rf', which is not one of the request's"),
    "mistral v11, a later unknown tool": (
        "mistral", '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]rm_rf[ARGS]{}', "'rm_rf'"),
}  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "why"), REJECTED.values(), ids=REJECTED.keys())
def test_a_call_rejected_after_it_opened_is_reported_not_complete(parser, text, why):
    """What was streamed stands, but the stream says the calls are not complete and
    why; the whole reply returns the text as content."""
    stream = ToolCallStream(PARSERS[parser], NAMES, incremental=True)
    deltas = [d for piece in _pieces(text, 3) for d in stream.feed(piece)]
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "add"
    stream.finish()
    assert not stream.complete and why in (stream.error or ""), stream.error
    assert [c["function"]["name"] for c in stream.calls] == ["add"]
    assert split_message(ToolCallStream(PARSERS[parser], NAMES), text) == (text, [])


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "rm_rf", "arguments": {"a": 1}}</tool_call>',
    '<tool_call>{"arguments": {"a": 1}, "name": "rm_rf"}</tool_call>',
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
])  # fmt: skip
def test_a_call_that_never_opens_stays_content(text):
    """An unknown tool, or arguments that are not an object: no call opens, so the
    reply is content, as the whole reply's is, and nothing is rejected."""
    stream = ToolCallStream(PARSERS["hermes"], NAMES, incremental=True)
    deltas = [d for piece in _pieces(text, 5) for d in stream.feed(piece)] + stream.finish()
    assert "".join(d["content"] for d in deltas) == text
    assert stream.complete and not stream.calls


def test_the_scanner_reads_keys_in_any_order_and_strings_whole():
    text = '{"x": [1, "}"], "parameters": {"q": "{\\"}"}, "name": "f\\u00e9", "n": -1.5e2}'
    scan = CallScanner(0, ("arguments", "parameters"))
    for i in range(len(text)):
        scan.scan(text[: i + 1])
        if i + 1 < text.index('"f'):
            assert scan.name is None
    assert scan.name == "fé" and not scan.failed and scan.end == len(text)
    assert text[scan.args_start : scan.args_end] == '{"q": "{\\"}"}'
    for bad in ('{"name" "f"}', '{"name": "f",}', '["name"]', '{"a": 1 "b": 2}'):
        broken = CallScanner(0)
        broken.scan(bad)
        assert broken.failed, bad
    bare = CallScanner.bare_arguments(3, "add")
    bare.scan('xx {"a": {"b": "}"}} trailing')
    assert (bare.args_start, bare.args_end, bare.end) == (3, 20, 20)


# -- the Responses API's items --------------------------------------------------------


def _builder_events(parser: str, text: str, reason: str) -> tuple[list[dict], ResponseBuilder]:
    builder = ResponseBuilder({"id": "resp_x", "output": [], "error": None})
    events = builder.opening()
    stream = ToolCallStream(PARSERS[parser], NAMES, incremental=True)
    for piece in _pieces(text, 2):
        events += builder.feed(stream.feed(piece))
    events += builder.feed(stream.finish())
    events += builder.finish(reason, {}, stream.error)
    return events, builder


def test_a_rejected_call_is_an_incomplete_item_of_a_failed_response():
    events, builder = _builder_events("hermes", REJECTED["malformed JSON after the call opened"][1],
                                      "stop")  # fmt: skip
    (item,) = builder.body["output"]
    assert item["type"] == "function_call" and item["status"] == "incomplete"
    assert builder.body["status"] == "failed"
    assert "malformed" in builder.body["error"]["message"]
    assert [e["type"] for e in events[-3:]] == ["response.output_item.done", "error",
                                                "response.failed"]  # fmt: skip
    assert events[-3]["item"]["status"] == "incomplete"


def test_a_call_cut_by_max_output_tokens_is_incomplete():
    events, builder = _builder_events("json", REJECTED["cut by max_tokens"][1], "length")
    (item,) = builder.body["output"]
    assert item["status"] == "incomplete" and builder.body["status"] == "incomplete"
    assert builder.body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete"


def test_a_streamed_call_of_every_format_is_a_completed_item():
    for parser, text in FORMATS.values():
        events, builder = _builder_events(parser, text, "stop")
        item = builder.body["output"][-1]
        assert item["status"] == "completed" and item["arguments"] == ARGS, parser
        deltas = [e["delta"] for e in events
                  if e["type"] == "response.function_call_arguments.delta"]  # fmt: skip
        assert len(deltas) >= 5 and "".join(deltas) == ARGS, parser
        assert builder.body["status"] == "completed"


# -- through HTTP: the tiny model, its replies forced ------------------------------------

LONG = {  # a tool whose arguments are 200+ characters
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 220, "maxLength": 260}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
ASK = [{"role": "user", "content": "Take a note."}]
NOTE_ARGS = json.dumps({"text": "a long note, " * 18, "tags": ["x", {"y": "}"}]})
REPLIES = {  # the gateway's tool_parser: a reply in its format (forced by guided_choice)
    "hermes": f'<tool_call>\n{{"name": "note", "arguments": {NOTE_ARGS}}}\n</tool_call>',
    "llama3_json": f'<|python_tag|>{{"name": "note", "parameters": {NOTE_ARGS}}}',
    "mistral": f"[TOOL_CALLS]note[ARGS]{NOTE_ARGS}",
}


def _chat_stream(oai: openai.OpenAI, **body: Any) -> tuple[list[str], Any]:
    """The argument fragments of a streamed chat reply, and its final choice."""
    fragments: list[str] = []
    with oai.chat.completions.stream(model="default", messages=ASK, tools=[LONG],
                                     temperature=0, **body) as stream:  # fmt: skip
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta" and event.arguments_delta:
                fragments.append(event.arguments_delta)
        return fragments, stream.get_final_completion().choices[0]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_chat_streams_each_parsers_calls_as_generated(tiny_gateway, parser):
    server, _ = tiny_gateway(tool_parser=parser)
    body = {"max_tokens": 400, "extra_body": {"guided_choice": [REPLIES[parser]]}}
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as oai:
        fragments, streamed = _chat_stream(oai, **body)
        whole = oai.chat.completions.create(model="default", messages=ASK, tools=[LONG],
                                            temperature=0, **body).choices[0]  # fmt: skip
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert call.function.name == "note" and call.function.arguments == NOTE_ARGS
    assert len(fragments) >= 5 and "".join(fragments) == NOTE_ARGS
    assert streamed.message.tool_calls[0].function.arguments == NOTE_ARGS


def test_chat_streams_a_forced_call_as_generated(tiny_gateway):
    server, _ = tiny_gateway()
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as oai:
        fragments, streamed = _chat_stream(oai, tool_choice="required", max_tokens=400)
    assert streamed.finish_reason == "tool_calls"
    (call,) = streamed.message.tool_calls
    assert len(json.loads(call.function.arguments)["text"]) >= 220  # the schema's minLength
    assert len(fragments) >= 5 and "".join(fragments) == call.function.arguments


def _sse_events(http, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize(("body", "reason", "why"), [
    ({"tool_choice": "required", "max_tokens": 24}, "length", "cut short"),
    ({"guided_choice": ['<tool_call>{"name": "note", "arguments": {"text": "x" 1}}</tool_call>'],
      "max_tokens": 100}, "stop", "malformed"),
], ids=["cut by max_tokens", "malformed"])  # fmt: skip
def test_chat_a_rejected_streamed_call_ends_with_an_error_not_tool_calls(tiny_gateway, body,
                                                                         reason, why):  # fmt: skip
    _, http = tiny_gateway()
    events = _sse_events(http, {"messages": ASK, "tools": [LONG], "temperature": 0,
                                "stream": True, **body})  # fmt: skip
    *chunks, error = events
    assert "error" in error and why in error["error"]["message"], error
    assert error["error"]["message"].startswith("choice 0: ")
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finish == [reason]  # never "tool_calls"
    opened = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert opened and opened[0]["function"]["name"] == "note"


def test_responses_streams_a_call_as_generated_and_a_cut_one_is_incomplete(tiny_gateway):
    server, _ = tiny_gateway()
    flat = {"type": "function", **LONG["function"]}
    args = dict(model="default", input="Take a note.", tools=[flat], tool_choice="required",
                temperature=0)  # fmt: skip
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as oai:
        with oai.responses.stream(**args, max_output_tokens=400) as stream:
            deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
            final = stream.get_final_response()
        whole = oai.responses.create(**args, max_output_tokens=400)
        cut = list(oai.responses.create(**args, max_output_tokens=24, stream=True))
    (call,) = final.output
    assert final.status == "completed" and call.status == "completed"
    assert len(call.arguments) >= 200 and call.arguments == whole.output[0].arguments
    assert len(deltas) >= 5 and "".join(deltas) == call.arguments
    done = [e.item for e in cut if e.type == "response.output_item.done"]
    assert [item.status for item in done] == ["incomplete"]
    assert cut[-1].type == "response.incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"
