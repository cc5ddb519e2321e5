"""`ToolCallStream`: one choice's text split into content and tool calls as it arrives,
in OpenAI's delta shapes (``{"content": ...}``, ``{"tool_calls": [...]}``).

Contract: text is content until a call's start marker (`tool_calls.ToolParser`); from
the marker on it is held, and read as it grows (`call_scanner.CallScanner`): once a
call's function name is known and names a tool of the request, and its arguments have
begun, the call opens (a delta with its ``index``, ``id`` and name) and its arguments
stream as the model writes them (deltas carrying ``function.arguments`` fragments, the
model's own JSON text) until their object closes. What streams when, per format:

* ``hermes`` ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, ``json`` (a
  forced call), ``llama3_json`` (``{"name": ..., "parameters": {...}}``, after
  ``<|python_tag|>`` or not, several separated by ``;``) and ``mistral``'s array form
  (``[TOOL_CALLS][{...}, {...}]``): each call object's arguments stream as written
  when its ``name`` comes first; when the arguments come first (``{"arguments": {...},
  "name": ...}``) their text is held until the name is known, then sent at once and
  streamed from there on. Arguments given as a JSON string that holds an object are
  sent when the string ends, as its content;
* ``mistral`` v11 (``[TOOL_CALLS]name[ARGS]{...}``): the name comes first, the
  arguments stream as written.

Calls stream one after the other as the format allows (hermes: text may come between
them); with ``parallel_tool_calls`` false only the first streams. Text around calls
(after the first call's marker) comes when the choice finishes, when the held text is
parsed: the calls that could not stream (after text the format does not allow between
calls) come out whole then.

Two modes. A streamed choice (``incremental``) lets deltas out as they come. A whole
reply holds every delta until the end, so output that does not parse (an unclosed
tag, invalid JSON, a tool name the request did not offer) is returned as plain
content, unchanged. A streamed choice cannot take back a call it has opened: when the
parser rejects the reply after that (malformed JSON, a cut by ``max_tokens``, a call
of a tool the request did not offer, calls that differ from those streamed), the
opened calls stay as sent, `complete` is False and `error` says why (the chat stream
then ends without ``finish_reason: "tool_calls"`` and with an error event; the
Responses API marks the call ``incomplete`` and the response ``incomplete`` or
``failed``). Otherwise the streamed deltas reassemble to exactly the whole reply's
message.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from radixserve.services.gateway.tools.call_scanner import CallScanner
from radixserve.services.gateway.tools.reasoning import partial_marker
from radixserve.services.gateway.tools.tool_calls import ToolParser, new_call_id

_MAX_HEAD_CHARS = 256  # held text past a call's end without the next opener: no more streaming


@dataclass
class _Call:
    """A call read from the held text (`scan`); `call_id` once it has opened."""

    scan: CallScanner
    call_id: str = ""
    sent: list[str] = field(default_factory=list)  # the arguments text sent so far
    sent_len: int = 0

    @property
    def name(self) -> str:
        return self.scan.name or ""

    @property
    def arguments(self) -> str:
        return "".join(self.sent)


@dataclass
class ToolCallStream:
    """One choice's text as content and tool calls (see the module docstring).

    `feed` returns the deltas that can be sent now; `finish` those left at the end.
    `calls` holds the calls once finished (empty: a plain reply); `error` says why a
    streamed choice's calls were rejected after one had opened (None: they were not).
    """

    parser: ToolParser
    tool_names: Collection[str]
    single: bool = False  # return at most one call (parallel_tool_calls false)
    incremental: bool = False  # a streamed choice: deltas go out as they come
    calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    _pending: str = ""  # not yet sent: trailing whitespace, a possible marker prefix
    _held: str | None = None  # from a start marker on (None: no marker seen)
    _sent: bool = False  # any content sent
    _opened: list[_Call] = field(default_factory=list)  # calls streamed, in order
    _reading: _Call | None = None  # the call being read (opened or not yet)
    _scan_from: int = 0  # where the next call may start in the held text
    _streaming: bool = True  # False once a call cannot stream: the rest is held
    _kept: list[dict[str, Any]] = field(default_factory=list)  # a whole reply's deltas

    @property
    def complete(self) -> bool:
        """No streamed call was rejected (False: `error` says why)."""
        return self.error is None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._held is not None:
            self._held += text
            return self._release(self._advance())
        buf = self._pending + text
        start = self._start(buf)
        if start is not None:
            self._pending, self._held = buf[:start], buf[start:]
            return self._release(self._advance())
        # the start of a marker may end the text, and whitespace precede it
        keep = partial_marker(buf, self.parser.markers)
        head = buf[: len(buf) - keep]
        keep += len(head) - len(head.rstrip())
        cut = len(buf) - keep
        if not self._sent and not buf[:cut].strip() and self.parser.leading:
            cut = 0  # a leading marker may still come after this whitespace
        self._pending = buf[cut:]
        return self._content(buf[:cut])

    def finish(self) -> list[dict[str, Any]]:
        """The deltas left once the choice has finished; sets `calls` (and `error`)."""
        if self._held is None:
            return self._content(self._pending)
        parsed = self.parser.parse(self._held)
        if parsed is not None and self._agrees(parsed[0]):
            kept, self._kept = self._kept, []
            return kept + self._rest(*parsed)
        if not self.incremental or not self._opened:  # malformed: plain content
            self._opened, self._kept = [], []
            return self._content(self._pending + self._held)
        self.error = self._rejection(parsed[0] if parsed else None)
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
        """Read the held text on: open the calls whose name is known and send their
        arguments written so far."""
        held, deltas = self._held or "", []
        while self._streaming:
            if self._reading is None:
                self._reading = self._next_call(held)
                if self._reading is None:
                    break
            call = self._reading
            call.scan.scan(held)
            deltas += self._stream(call, held)
            if not call.scan.done or not self._streaming:
                break
            self._reading = None
            if call.scan.failed or not call.call_id:
                self._streaming = False  # not a call that can stream: the rest is held
                break
            self._scan_from = call.scan.end or 0
            self._streaming = not self.single
        return deltas

    def _next_call(self, held: str) -> _Call | None:
        """The next call, once its opener is in the held text."""
        opener = self.parser.opener
        if opener is None:
            self._streaming = False
            return None
        find = opener.search if self.parser.apart else opener.match
        found = find(held, self._scan_from)
        if found is None:
            if not self.parser.apart and len(held) - self._scan_from > _MAX_HEAD_CHARS:
                self._streaming = False
            return None
        name = found.groupdict().get("name")
        if name is not None:  # the name came first: what follows is the arguments object
            return _Call(CallScanner.bare_arguments(found.end(), name))
        return _Call(CallScanner(found.end(), self.parser.args_keys))

    def _stream(self, call: _Call, held: str) -> list[dict[str, Any]]:
        """The deltas of `call` since the last: its opening once it can open, then the
        arguments text it gained."""
        deltas: list[dict[str, Any]] = []
        if not call.call_id:
            if not self._can_open(call.scan, held):
                return []
            deltas += [] if self._opened else self._content(self._pending.rstrip())
            call.call_id = new_call_id()
            self._opened.append(call)
            deltas.append({"tool_calls": [{"index": len(self._opened) - 1, "id": call.call_id,
                                           "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})  # fmt: skip
        piece = _arguments(call.scan, held, call.sent_len)
        if piece:
            call.sent.append(piece)
            call.sent_len += len(piece)
            deltas.append({"tool_calls": [{"index": len(self._opened) - 1,
                                           "function": {"arguments": piece}}]})  # fmt: skip
        return deltas

    def _can_open(self, scan: CallScanner, held: str) -> bool:
        """A call opens once its name and the start of its arguments are known (or its
        object ended without arguments: ``{}``), its name is a tool of the request and
        its arguments are an object (a JSON string holding one: once the string ends).
        False while that may still come; when it never will, the rest is held."""
        if scan.name is None or (scan.args_start is None and scan.end is None):
            return False
        if scan.name not in self.tool_names or scan.args_kind not in ("", "{", '"'):
            self._streaming = False
            return False
        if scan.args_kind == '"':
            if scan.args_end is None:
                return False
            if not is_json_object(_arguments(scan, held)):
                self._streaming = False
                return False
        return True

    def _agrees(self, parsed: list[tuple[str, dict[str, Any]]]) -> bool:
        """The parsed calls name offered tools and begin with the streamed ones."""
        if any(name not in self.tool_names for name, _ in parsed):
            return False
        if len(self._opened) > len(parsed[:1] if self.single else parsed):
            return False
        return all(c.scan.end is not None and c.name == name and _loads(c.arguments) == args
                   for c, (name, args) in zip(self._opened, parsed))  # fmt: skip

    def _rejection(self, parsed: list[tuple[str, dict[str, Any]]] | None) -> str:
        """Why the reply's calls were rejected after the last streamed one opened."""
        index, last = len(self._opened) - 1, self._opened[-1]
        where = f"tool call {index} ({last.name}, {last.call_id})"
        if parsed is not None:
            unknown = [name for name, _ in parsed if name not in self.tool_names]
            if unknown:
                return f"the reply calls {unknown[0]!r}, which is not one of the request's tools"
            return f"the reply's {self.parser.name} tool calls differ from the streamed ones"
        if last.scan.end is None and not last.scan.failed:
            return f"{where} was cut short: its JSON does not end"
        return f"the reply's {self.parser.name} tool-call text is malformed from {where} on"

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


def _arguments(scan: CallScanner, held: str, sent: int = 0) -> str:
    """The arguments text of the call `scan` reads, as far as it is known, from its
    `sent` th character on: the model's own JSON text of an object (a slice of the new
    part only: long arguments fed token by token cost no quadratic copying), the
    content of a JSON string once it has ended, ``{}`` for an object that ended
    without arguments."""
    if scan.args_start is None:
        return "{}"[sent:] if scan.end is not None else ""
    stop = scan.args_end if scan.args_end is not None else scan.pos
    if scan.args_kind != '"':
        return held[scan.args_start + sent : stop]
    value = _loads(held[scan.args_start : stop]) if scan.args_end is not None else None
    return value[sent:] if isinstance(value, str) else ""


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
