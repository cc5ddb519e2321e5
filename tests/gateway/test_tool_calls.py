"""Tool-call parsers per model family, malformed output as plain content, and the
streaming splitter: arguments streamed as they are generated, reassembling to the
non-streamed message (no engine)."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.services.gateway.tools.tool_calls import PARSERS, parser_for_template
from radixserve.services.gateway.tools.tool_request import ToolPlan
from radixserve.services.gateway.tools.tool_stream import ToolCallStream, split_message

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
    # the v11 tokenizers' form (Mistral Small 3.2, Magistral, Devstral)
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}', None,
     [("get_weather", {"city": "Bern"})]),
    ("mistral", 'On it. [TOOL_CALLS]add[ARGS]{"a": 1, "b": {"c": "}"}}[TOOL_CALLS]'
     'get_weather[CALL_ID]a1B2c3D4e[ARGS] {"city": "Oslo"}', "On it.",
     [("add", {"a": 1, "b": {"c": "}"}}), ("get_weather", {"city": "Oslo"})]),
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
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1'),  # v11, cut short
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1} trailing words'),
    ("mistral", '[TOOL_CALLS]add[ARGS][1, 2]'),  # v11, arguments not an object
    ("mistral", '[TOOL_CALLS]rm_rf[ARGS]{}'),  # v11, unknown tool
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


def _deltas(parser: str, text: str, step: int) -> list[dict]:
    """The deltas of `text` streamed in pieces of `step` characters."""
    stream = ToolCallStream(PARSERS[parser], NAMES, incremental=True)
    deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i : i + step])]
    return deltas + stream.finish()


def _reassembled(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """The message as the OpenAI SDK reassembles deltas: content concatenated; per
    call index, its id and name, and its arguments concatenated."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            call = calls.setdefault(tc["index"], {"id": tc.get("id"), "name": "", "arguments": ""})
            call["name"] += tc["function"].get("name", "")
            call["arguments"] += tc["function"].get("arguments", "")
    return content or None, list(calls.values())


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_deltas_reassemble_to_the_message(step):
    for parser, text, *_ in CASES:
        content, calls = split(parser, text)
        got_content, got_calls = _reassembled(_deltas(parser, text, step))
        assert got_content == content, (parser, text)
        whole = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert [(c["name"], c["arguments"]) for c in got_calls] == whole, (parser, text)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_malformed_streams_are_content_or_the_calls_already_sent(step):
    """Malformed output streams as content, unless a call had opened before it turned
    out malformed: then what was sent stands (the model's own text, nothing invented)."""
    opened = 0
    for parser, text in MALFORMED:
        content, calls = _reassembled(_deltas(parser, text, step))
        if not calls:
            assert content == text, (parser, text)
            continue
        opened += 1
        assert all(c["name"] in NAMES and c["arguments"] in text for c in calls), (parser, text)
        assert content is None or text.startswith(content), (parser, text)
    assert 0 < opened < len(MALFORMED)


def test_text_before_a_call_streams_before_it_ends():
    stream = ToolCallStream(PARSERS["hermes"], NAMES, incremental=True)
    assert stream.feed("Checking the ") == [{"content": "Checking the"}]
    assert stream.feed("weather <tool") == [{"content": " weather"}]  # "<tool" held back
    assert stream.feed('_call>{"name": "get_weather", "argu') == []
    assert stream.feed('ments": ') == []  # an object or not: not known yet
    opening, fragment = stream.feed('{"ci')
    call = opening["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": ""} and call["index"] == 0
    assert call["id"].startswith("call_")
    assert fragment == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert stream.feed('ty": "Oslo"}}</tool_call>') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}]  # fmt: skip
    assert stream.finish() == [] and len(stream.calls) == 1


@pytest.mark.parametrize("parser", ["hermes", "json", "llama3_json", "mistral"])
def test_arguments_stream_as_they_are_generated(parser):
    """Each family's call: its arguments go out token by token, before the reply ends,
    and add up to the arguments of the whole reply."""
    args = '{"city": "Rio de Janeiro", "days": [1, 2, {"x": "}\\""}]}'
    text = {
        "hermes": f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>',
        "json": f'{{"name": "get_weather", "arguments": {args}}}',
        "llama3_json": f'<|python_tag|>{{"name": "get_weather", "parameters": {args}}}',
        "mistral": f"[TOOL_CALLS]get_weather[ARGS]{args}",
    }[parser]
    stream = ToolCallStream(PARSERS[parser], NAMES, incremental=True)
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    before_end = [d for piece in pieces for d in stream.feed(piece)]
    fragments = [tc["function"]["arguments"] for d in before_end for tc in d["tool_calls"]
                 if "id" not in tc]  # fmt: skip
    assert len(fragments) >= len(args) // 4 - 1  # one per piece of text, about
    assert "".join(fragments) == args
    assert stream.finish() == [] and stream.complete
    assert [c["function"]["arguments"] for c in stream.calls] == [args]
    assert split(parser, text)[1][0]["function"]["arguments"] == args  # the same, whole


def test_a_streamed_call_cut_short_stays_as_sent():
    """A streamed call cannot be taken back: cut by max_tokens, it keeps the arguments
    sent (incomplete: not counted as a finished call); the whole reply is content."""
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b'
    deltas = _deltas("hermes", text, 5)
    assert _reassembled(deltas) == (None, [{"id": deltas[0]["tool_calls"][0]["id"],
                                           "name": "add", "arguments": '{"a": 1, "b'}])  # fmt: skip
    stream = ToolCallStream(PARSERS["hermes"], NAMES, incremental=True)
    stream.feed(text)
    stream.finish()
    assert not stream.complete
    assert split("hermes", text) == (text, [])


def test_calls_stream_in_order_whatever_their_key_order():
    """A call whose arguments come before its name streams once the name is known,
    after the call before it, in order."""
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
            '<tool_call>{"arguments": {"city": "Lima"}, "name": "get_weather"}</tool_call>')  # fmt: skip
    deltas = _deltas("hermes", text, 2)
    content, calls = _reassembled(deltas)
    assert content is None
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("add", {"a": 1}), ("get_weather", {"city": "Lima"})]  # fmt: skip
    assert _reassembled(_deltas("hermes", text, 1000))[1][0]["arguments"] == '{"a": 1}'


def test_parser_chosen_from_the_template():
    assert parser_for_template("{{ '<tool_call>' }}{{ tools | tojson }}") == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template(None) == "hermes"


@pytest.mark.parametrize(("parser", "reply"), [
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'),
    ("llama3_json", 'Let me add. <|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'),
])  # fmt: skip
def test_the_parsers_see_the_special_markers_the_decode_keeps(parser, reply):
    """Mistral's and Llama 3's markers are special tokens, which a decode leaves out of
    the text: the tool plan keeps them (`kept_token_ids`), so the reply parses; with
    them dropped, it does not (it stays content)."""
    vocab = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    vocab.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # a token per character
    vocab.add_tokens(list(set(reply)))
    vocab.add_special_tokens([AddedToken(t, special=True) for t in
                              ("[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "</s>")])  # fmt: skip
    vocab.decoder = decoders.Fuse()

    class Vocab:
        def decode(self, ids, skip_special_tokens=True):
            return vocab.decode(list(ids), skip_special_tokens=skip_special_tokens)

        def token_to_id(self, token):
            return vocab.token_to_id(token)

    ids = vocab.encode(reply + "</s>").ids
    plan = ToolPlan(parser, frozenset(NAMES), single=False)
    kept = plan.kept_token_ids(Vocab())  # type: ignore[arg-type]
    assert len(kept) == {"mistral": 2, "llama3_json": 1}[parser]  # [CALL_ID] is not in it

    def decoded(kept_ids) -> str:
        detok = IncrementalDetokenizer(Vocab(), kept=kept_ids)
        return "".join(detok.add(i) for i in ids) + detok.flush()

    assert decoded(kept) == reply
    _, calls = split_message(plan.stream(incremental=False), decoded(kept))
    assert calls_of(calls) == [("add", {"a": 1, "b": 2})]
    dropped = decoded(())
    assert "[TOOL_CALLS]" not in dropped and "<|python_tag|>" not in dropped
    if parser == "mistral":
        assert split_message(plan.stream(incremental=False), dropped) == (dropped, [])
