"""`ToolCallStream`: one choice's text split into content and tool calls as it arrives,
in OpenAI's delta shapes (``{"content": ...}``, ``{"tool_calls": [...]}``).

Contract: text is content until a call's start marker (`tool_calls.ToolParser`); from
the marker on it is held. Once a call's function name is known (the parser's `head`)
and names a tool of the request, the call opens (a delta with its ``index``, ``id``
and name) and its arguments stream as the model writes them (deltas carrying
``function.arguments`` fragments, the model's own JSON text) until their object
closes. When the choice finishes, the held text is parsed: the calls that did not
stream (another key order, the Mistral array form) come out whole, and text around the
calls becomes content.

Two modes. A streamed choice (``incremental``) lets deltas out as they come. A whole
reply holds every delta until the end, so output that does not parse (an unclosed
tag, invalid JSON, a tool name the request did not offer) is returned as plain
content, unchanged. A streamed choice cannot take back a call it has opened: when the
text after it turns out malformed (e.g. ``max_tokens`` cut it), the opened calls stay
as sent and `complete` is False. Otherwise the streamed deltas reassemble to exactly
the whole reply's message.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from radixserve.services.gateway.tool_calls import ToolParser, new_call_id

_MAX_HEAD_CHARS = 256  # past this after an opener without a head match, a call won't stream


@dataclass
class _ObjectEnd:
    """Finds where a JSON object ends, fed its text piece by piece (strings and escapes
    followed, so braces inside strings do not count)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str) -> int | None:
        """Consume `text`; how much of it completes the object, or None if it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass
class _OpenCall:
    """A call whose arguments are streaming: from `start` in the held text on."""

    call_id: str
    name: str
    start: int
    arguments: str = ""  # the arguments text sent so far
    end: _ObjectEnd = field(default_factory=_ObjectEnd)
    closed: bool = False  # the arguments object has ended


@dataclass
class ToolCallStream:
    """One choice's text as content and tool calls (see the module docstring).

    `feed` returns the deltas that can be sent now; `finish` those left at the end.
    `calls` holds the calls once finished (empty: a plain reply).
    """

    parser: ToolParser
    tool_names: Collection[str]
    single: bool = False  # return at most one call (parallel_tool_calls false)
    incremental: bool = False  # a streamed choice: deltas go out as they come
    calls: list[dict[str, Any]] = field(default_factory=list)
    _pending: str = ""  # not yet sent: trailing whitespace, a possible marker prefix
    _held: str | None = None  # from a start marker on (None: no marker seen)
    _sent: bool = False  # any content sent
    _opened: list[_OpenCall] = field(default_factory=list)  # calls streamed, in order
    _scan_from: int = 0  # where the next call may start in the held text
    _streaming: bool = True  # False once a call cannot stream: the rest is held
    _kept: list[dict[str, Any]] = field(default_factory=list)  # a whole reply's deltas

    @property
    def complete(self) -> bool:
        """Every call's arguments parse (False: a streamed call was cut short)."""
        return all(is_json_object(c["function"]["arguments"]) for c in self.calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._held is not None:
            self._held += text
            return self._release(self._advance())
        buf = self._pending + text
        start = self._start(buf)
        if start is not None:
            self._pending, self._held = buf[:start], buf[start:]
            return self._release(self._advance())
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
        if parsed is not None and self._agrees(parsed[0]):
            kept, self._kept = self._kept, []
            return kept + self._rest(*parsed)
        if not self.incremental or not self._opened:  # malformed: plain content
            self._opened, self._kept = [], []
            return self._content(self._pending + self._held)
        for call in self._opened:  # a streamed call cannot be taken back
            self._record(call.call_id, call.name, call.arguments)
        return []

    def _start(self, buf: str) -> int | None:
        """Where a call starts in `buf`, if it does."""
        if not self._sent:
            stripped = buf.lstrip()
            if stripped and any(stripped.startswith(m) for m in self.parser.leading):
                return len(buf) - len(stripped)
        found = [i for i in (buf.find(m) for m in self.parser.markers) if i >= 0]
        return min(found) if found else None

    def _advance(self) -> list[dict[str, Any]]:
        """Open the calls whose name is known and send their arguments written so far."""
        held, deltas = self._held or "", []
        while True:
            call = self._opened[-1] if self._opened else None
            if call is not None and not call.closed:
                rest = held[call.start + len(call.arguments) :]
                end = call.end.scan(rest)
                piece = rest if end is None else rest[:end]
                if piece:
                    call.arguments += piece
                    deltas.append({"tool_calls": [{"index": len(self._opened) - 1,
                                                   "function": {"arguments": piece}}]})  # fmt: skip
                if end is None:
                    return deltas
                call.closed, self._scan_from = True, call.start + len(call.arguments)
                self._streaming = self._streaming and not self.single
            if not self._streaming:
                return deltas
            opened = self._open_next(held)
            if opened is None:
                return deltas
            deltas += opened

    def _open_next(self, held: str) -> list[dict[str, Any]] | None:
        """The deltas opening the next call once its head is complete; None while it is
        not (or never will be: the rest is then held)."""
        opener, head = self.parser.opener, self.parser.head
        found = opener.search(held, self._scan_from) if opener else None
        if found is None or head is None:
            return None
        match = head.match(held, found.start())
        if match is None or match["name"] not in self.tool_names:
            if match is not None or len(held) - found.start() > _MAX_HEAD_CHARS:
                self._streaming = False
            return None
        deltas = [] if self._opened else self._content(self._pending.rstrip())
        call = _OpenCall(new_call_id(), match["name"], match.end())
        self._opened.append(call)
        deltas.append({"tool_calls": [{"index": len(self._opened) - 1, "id": call.call_id,
                                       "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})  # fmt: skip
        return deltas

    def _agrees(self, parsed: list[tuple[str, dict[str, Any]]]) -> bool:
        """The parsed calls name offered tools and begin with the streamed ones."""
        if any(name not in self.tool_names for name, _ in parsed):
            return False
        if len(self._opened) > len(parsed[:1] if self.single else parsed):
            return False
        return all(c.closed and c.name == name and _loads(c.arguments) == args
                   for c, (name, args) in zip(self._opened, parsed))  # fmt: skip

    def _rest(self, parsed: list[tuple[str, dict[str, Any]]], rest: str) -> list[dict[str, Any]]:
        """What follows the streamed calls in a reply that parsed: the text before its
        first call (if no call opened), the text around the calls, the calls that did not
        stream; records `calls`."""
        deltas = [] if self._opened else self._content(self._pending.rstrip())
        if rest:
            deltas += self._content(("\n" if self._sent else "") + rest)
        for call in self._opened:
            self._record(call.call_id, call.name, call.arguments)
        for name, args in (parsed[:1] if self.single else parsed)[len(self._opened) :]:
            call_id, arguments = new_call_id(), json.dumps(args, ensure_ascii=False)
            index = self._record(call_id, name, arguments)
            deltas.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                           "function": {"name": name, "arguments": ""}}]})  # fmt: skip
            deltas.append({"tool_calls": [{"index": index,
                                           "function": {"arguments": arguments}}]})  # fmt: skip
        return deltas

    def _record(self, call_id: str, name: str, arguments: str) -> int:
        self.calls.append({"id": call_id, "type": "function",
                           "function": {"name": name, "arguments": arguments}})  # fmt: skip
        return len(self.calls) - 1

    def _release(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`deltas` to send now (streamed), or kept for the end (a whole reply)."""
        if self.incremental:
            return deltas
        self._kept += deltas
        return []

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self._sent = True
        return [{"content": text}]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def is_json_object(text: str) -> bool:
    """`text` is a JSON object (a call's whole arguments)."""
    return isinstance(_loads(text), dict)


def split_message(stream: ToolCallStream, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole reply, as its streamed deltas add up."""
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    if not stream.calls:
        return text, []  # a plain reply, unchanged
    return content or None, stream.calls
