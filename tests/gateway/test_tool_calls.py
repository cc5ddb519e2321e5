"""Tool-call parsers per model family, malformed output as plain content, and the
streaming splitter reassembling to the non-streamed message (no engine)."""

from __future__ import annotations

import json

import pytest

from radixserve.services.gateway.tool_calls import (
    PARSERS,
    ToolCallStream,
    parser_for_template,
    split_message,
)

NAMES = ("get_weather", "add")


def split(parser: str, text: str, single: bool = False):
    return split_message(ToolCallStream(PARSERS[parser], NAMES, single), text)


def calls_of(calls) -> list[tuple[str, dict]]:
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


CASES = [  # parser, text, content, calls
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ("hermes", 'Let me check.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
     '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
     "</tool_call>", "Let me check.", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
     '{"name": "add", "parameters": {"a": 2}}', None, [("add", {"a": 1}), ("add", {"a": 2})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3, "b": 4}}]', None,
     [("add", {"a": 3, "b": 4})]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lima"}}]',
     "Sure.", [("get_weather", {"city": "Lima"})]),
    ("mistral", '[{"name": "add", "arguments": {}}]', None, [("add", {})]),  # marker dropped
    ("json", '{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
]  # fmt: skip

MALFORMED = [  # parser, text: returned unchanged as content
    ("hermes", 'Ok <tool_call>{"name": "add", "arguments": {"a": 1}}'),  # unclosed
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>'),  # bad JSON
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),  # unknown tool
    ("hermes", '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'),  # not an object
    ("hermes", "Plain text, no call at all."),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}} and more text'),
    ("llama3_json", '{"colour": "red"}'),
    ("mistral", "[TOOL_CALLS][{]"),
    ("mistral", "[1, 2, 3] are numbers"),
    ("json", '{"name": "add", "arguments": {"a": 1'),  # cut short by max_tokens
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_parsers_find_the_calls(parser, text, content, calls):
    got_content, got_calls = split(parser, text)
    assert got_content == content
    assert calls_of(got_calls) == calls


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_output_is_plain_content(parser, text):
    assert split(parser, text) == (text, [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    _, calls = split("hermes", CASES[1][1], single=True)
    assert calls_of(calls) == [("add", {"a": 1, "b": 2})]


def _streamed(parser: str, text: str, step: int) -> tuple[str | None, list[tuple[str, dict]]]:
    """Feed `text` in pieces of `step` characters; reassemble the deltas as the OpenAI
    SDK does (content concatenated; per index: id, name, arguments concatenated)."""
    stream = ToolCallStream(PARSERS[parser], NAMES)
    deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i : i + step])]
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            call["name"] += tc["function"].get("name", "")
            call["arguments"] += tc["function"].get("arguments", "")
    return content or None, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_deltas_reassemble_to_the_message(step):
    for parser, text, *_ in CASES + [(*m, None, None) for m in MALFORMED]:
        content, calls = split(parser, text)
        assert _streamed(parser, text, step) == (content, calls_of(calls)), (parser, text)


def test_text_before_a_call_streams_before_it_ends():
    stream = ToolCallStream(PARSERS["hermes"], NAMES)
    assert stream.feed("Checking the ") == [{"content": "Checking the"}]
    assert stream.feed("weather <tool") == [{"content": " weather"}]  # "<tool" held back
    assert stream.feed('_call>{"name": "get_weather", "arguments": {}}') == []
    assert stream.feed("</tool_call>") == []
    deltas = stream.finish()
    assert [list(d) for d in deltas] == [["tool_calls"], ["tool_calls"]]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}


def test_parser_chosen_from_the_template():
    assert parser_for_template("{{ '<tool_call>' }}{{ tools | tojson }}") == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template(None) == "hermes"
