"""Tool calls in a model's output: one parser per model family (`PARSERS`); the
`tool_stream.ToolCallStream` splits a choice's text into content and calls with them.

Formats (chosen by `parser_for_template` or the ``tool_parser`` setting):

* ``hermes`` (Hermes, Qwen 2.5/3, the generic rendering): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, any number, text around them;
* ``llama3_json`` (Llama 3.x): ``{"name": ..., "parameters": {...}}`` as the whole reply,
  optionally after ``<|python_tag|>``, several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (or the array
  alone, as the marker is a special token a decode may drop), or the v11 tokenizers'
  ``[TOOL_CALLS]name[ARGS]{...}`` (optionally ``[CALL_ID]id`` before ``[ARGS]``), one
  marker per call;
* ``json`` (a forced call: ``tool_choice`` required or a named function): the whole
  reply is the one ``{"name": ..., "arguments": {...}}`` object the grammar allowed.

A parser takes the text from a call's start marker on and returns the calls and the
text around them, or None when the text is malformed (an unclosed tag, invalid JSON,
arguments that are not an object). Its `opener` finds, in text still growing, where
each call's JSON begins, so that the `tool_stream.ToolCallStream` can read the call
(`call_scanner.CallScanner`) and stream its arguments as they are generated.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: one parsed call: (function name, arguments as a JSON object)
Call = tuple[str, dict[str, Any]]
#: a parser: the held text (from a start marker on) -> (calls, content) or None if malformed
Parse = Callable[[str], tuple[list[Call], str] | None]


def _call(obj: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> Call | None:
    """``{"name": str, "arguments": {...}}`` (or ``parameters``) as a Call; arguments
    given as a JSON string holding an object are accepted too."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def _json_values(text: str, separators: str) -> list[Any] | None:
    """Every JSON value in `text`, separated only by whitespace and `separators`."""
    decoder, pos = json.JSONDecoder(), 0
    values: list[Any] = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[list[Call], str] | None:
    calls: list[Call] = []
    for body in _HERMES_CALL.findall(text):
        values = _json_values(body, "")
        call = _call(values[0]) if values and len(values) == 1 else None
        if call is None:
            return None
        calls.append(call)
    rest = [part.strip() for part in _HERMES_CALL.split(text)[::2]]
    if "<tool_call>" in "".join(rest) or not calls:
        return None  # an unclosed tag
    return calls, "\n".join(part for part in rest if part)


def parse_llama3_json(text: str) -> tuple[list[Call], str] | None:
    values = _json_values(text.removeprefix("<|python_tag|>"), ";")
    calls = [_call(v) for v in values or ()]
    if not calls or None in calls:
        return None
    return calls, ""  # type: ignore[return-value]


_MISTRAL_V11_CALL = re.compile(
    r"\s*\[TOOL_CALLS\]\s*(?P<name>[A-Za-z0-9_-]{1,64})(?:\[CALL_ID\][A-Za-z0-9_-]{1,64})?\[ARGS\]\s*"
)


def _parse_mistral_v11(text: str) -> tuple[list[Call], str] | None:
    """``[TOOL_CALLS]name[ARGS]{...}`` repeated, nothing else."""
    decoder, pos, calls = json.JSONDecoder(), 0, []
    while pos < len(text.rstrip()):
        head = _MISTRAL_V11_CALL.match(text, pos)
        if head is None:
            return None
        try:
            args, pos = decoder.raw_decode(text, head.end())
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        calls.append((head["name"], args))
    return (calls, "") if calls else None


def parse_mistral(text: str) -> tuple[list[Call], str] | None:
    if "[ARGS]" in text:
        return _parse_mistral_v11(text)
    values = _json_values(text.removeprefix("[TOOL_CALLS]"), "")
    if not values or len(values) != 1 or not isinstance(values[0], list):
        return None
    calls = [_call(v) for v in values[0]]
    if not calls or None in calls:
        return None
    return calls, ""  # type: ignore[return-value]


def parse_json(text: str) -> tuple[list[Call], str] | None:
    values = _json_values(text, "")
    call = _call(values[0], ("arguments",)) if values and len(values) == 1 else None
    return None if call is None else ([call], "")


@dataclass(frozen=True)
class ToolParser:
    """A family's format: its parse function, where a call may start (`markers`
    anywhere in the reply, `leading` only at its start, after whitespace), and how its
    calls are read while they stream: `opener` matches from where the next call may
    begin (the start of the held text, or the end of the last call) up to the call's
    JSON: a ``{"name", "arguments"}`` object, or, where the pattern has a ``name``
    group (Mistral v11), the arguments object itself. `apart`: text may come between
    calls, so the next opener is searched for (else it must follow the last call).
    `args_keys`: the keys that hold a call object's arguments. `tokens`: its markers,
    which some vocabularies make special tokens that a decode leaves out unless asked
    to keep them."""

    name: str
    parse: Parse
    markers: tuple[str, ...]
    leading: tuple[str, ...] = ()
    opener: re.Pattern[str] | None = None
    apart: bool = False
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    tokens: tuple[str, ...] = ()


_OBJECT = r"\s*(?=\{)"  # the call's JSON is an object: its brace follows

PARSERS = {
    p.name: p
    for p in (
        ToolParser("hermes", parse_hermes, ("<tool_call>",), (),
                   re.compile(rf"<tool_call>{_OBJECT}"), apart=True,
                   tokens=("<tool_call>", "</tool_call>")),
        ToolParser("llama3_json", parse_llama3_json, ("<|python_tag|>",), ("{",),
                   re.compile(rf"(?:<\|python_tag\|>|\s*;)?{_OBJECT}"),
                   tokens=("<|python_tag|>",)),
        ToolParser("mistral", parse_mistral, ("[TOOL_CALLS]",), ("[",),
                   re.compile(rf"{_MISTRAL_V11_CALL.pattern}(?=\{{)"
                              rf"|\s*(?:\[TOOL_CALLS\]\s*)?\[{_OBJECT}|\s*,{_OBJECT}"),
                   tokens=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")),
        ToolParser("json", parse_json, (), ("",), re.compile(_OBJECT), args_keys=("arguments",)),
    )
}  # fmt: skip


def parser_for_template(source: str | None) -> str:
    """The parser a chat template's own tool format calls for; hermes (the generic
    rendering's format) when it shows none."""
    text = source or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or ('"parameters"' in text and "<|eot_id|>" in text):
        return "llama3_json"
    return "hermes"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
