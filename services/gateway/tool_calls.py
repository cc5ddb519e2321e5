"""Tool calls in a model's output: one parser per model family, and `ToolCallStream`,
which splits a choice's text into content and calls, streamed or not.

Formats (`PARSERS`, chosen by `parser_for_template` or the ``tool_parser`` setting):

* ``hermes`` (Hermes, Qwen 2.5/3, the generic rendering): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, any number, text around them;
* ``llama3_json`` (Llama 3.x): ``{"name": ..., "parameters": {...}}`` as the whole reply,
  optionally after ``<|python_tag|>``, several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (or the array
  alone, as the marker is a special token a decode may drop);
* ``json`` (a forced call: ``tool_choice`` required or a named function): the whole
  reply is the one ``{"name": ..., "arguments": {...}}`` object the grammar allowed.

Contract: text is content until a call's start marker; from the marker on it is held
back until the choice finishes, then parsed. Output that does not parse (an unclosed
tag, invalid JSON, arguments that are not an object, a tool name the request did not
offer) is returned as content, never an error. Whitespace next to a call is dropped.
The non-streamed message is built by the same `ToolCallStream`, so streamed deltas
reassemble to exactly the non-streamed message.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
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


def parse_mistral(text: str) -> tuple[list[Call], str] | None:
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
    """A family's format: its parse function and where a call may start (`markers`
    anywhere in the reply, `leading` only at its start, after whitespace)."""

    name: str
    parse: Parse
    markers: tuple[str, ...]
    leading: tuple[str, ...] = ()


PARSERS = {
    p.name: p
    for p in (
        ToolParser("hermes", parse_hermes, ("<tool_call>",)),
        ToolParser("llama3_json", parse_llama3_json, ("<|python_tag|>",), ("{",)),
        ToolParser("mistral", parse_mistral, ("[TOOL_CALLS]",), ("[",)),
        ToolParser("json", parse_json, (), ("",)),
    )
}


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


@dataclass
class ToolCallStream:
    """One choice's text split into content and tool calls as it arrives.

    `feed` returns the deltas (OpenAI ``delta`` dicts: ``{"content": ...}`` or
    ``{"tool_calls": [...]}``) that can be sent now; `finish` those left at the end.
    `calls` holds the parsed calls once finished (empty: a plain reply).
    """

    parser: ToolParser
    tool_names: Collection[str]
    single: bool = False  # return at most one call (parallel_tool_calls false)
    calls: list[dict[str, Any]] = field(default_factory=list)
    _pending: str = ""  # not yet sent: trailing whitespace, a possible marker prefix
    _held: str | None = None  # from a start marker on (None: no marker seen)
    _sent: bool = False  # any content sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._held is not None:
            self._held += text
            return []
        buf = self._pending + text
        start = self._start(buf)
        if start is not None:
            self._pending, self._held = buf[:start], buf[start:]
            return []
        keep = 0  # the start of a marker may end the text, and whitespace precede it
        for marker in self.parser.markers:
            keep = max(keep, next((n for n in range(len(marker) - 1, 0, -1)
                                   if buf.endswith(marker[:n])), 0))  # fmt: skip
        head = buf[: len(buf) - keep]
        keep += len(head) - len(head.rstrip())
        cut = len(buf) - keep
        if not self._sent and not buf[:cut].strip() and self.parser.leading:
            cut = 0  # a leading marker may still come after this whitespace
        self._pending = buf[cut:]
        return self._content(buf[:cut])

    def finish(self) -> list[dict[str, Any]]:
        """The deltas left once the choice has finished; sets `calls`."""
        if self._held is None:
            return self._content(self._pending)
        parsed = self.parser.parse(self._held)
        if parsed is None or any(name not in self.tool_names for name, _ in parsed[0]):
            return self._content(self._pending + self._held)  # malformed: plain content
        calls, rest = parsed
        calls = calls[:1] if self.single else calls
        deltas = self._content(self._pending.rstrip())
        if rest:
            deltas += self._content(("\n" if self._sent else "") + rest)
        for i, (name, args) in enumerate(calls):
            call_id, arguments = new_call_id(), json.dumps(args, ensure_ascii=False)
            self.calls.append({"id": call_id, "type": "function",
                               "function": {"name": name, "arguments": arguments}})  # fmt: skip
            # OpenAI's shape: the first delta names the call, the next carry arguments
            opening = {"index": i, "id": call_id, "type": "function",
                       "function": {"name": name, "arguments": ""}}  # fmt: skip
            deltas.append({"tool_calls": [opening]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": arguments}}]})
        return deltas

    def _start(self, buf: str) -> int | None:
        """Where a call starts in `buf`, if it does."""
        if not self._sent:
            stripped = buf.lstrip()
            if stripped and any(stripped.startswith(m) for m in self.parser.leading):
                return len(buf) - len(stripped)
        found = [i for i in (buf.find(m) for m in self.parser.markers) if i >= 0]
        return min(found) if found else None

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self._sent = True
        return [{"content": text}]


def split_message(stream: ToolCallStream, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole reply, as its streamed deltas add up."""
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    if not stream.calls:
        return text, []  # a plain reply, unchanged
    return content or None, stream.calls
