"""The reply side of Anthropic's Messages API: a message's content blocks, built from the
chat path's message deltas (``{"content": ...}``, ``{"tool_calls": [...]}``,
``{"reasoning_content": ...}`` as `choices.reply_deltas` lets them out), its usage and
stop reason, and the server-sent events that stream it.

Events, in Anthropic's order (the SDK's stream accumulator relies on it)::

    message_start (the message: content [], usage so far), ping
    per block:  content_block_start (text "", thinking "", or tool_use with input {}),
                content_block_delta ... (text_delta, thinking_delta (none with
                ``thinking.display`` omitted), input_json_delta with partial_json: the
                model's own JSON text), content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

with a ``ping`` whenever the stream was idle ``stream_ping_interval_s``, and an
``error`` event ending a stream whose generation failed. The non-streamed reply is
built by the same `MessageBuilder` (its events dropped), so a streamed reply
reassembles to exactly the non-streamed one.

Usage: ``cache_read_input_tokens`` are the prompt tokens served from the prefix cache
(any tier: device, host memory, disk), ``cache_creation_input_tokens`` those computed
in whole pages (what the cache keeps for the next request), ``input_tokens`` the rest
(the prompt's last partial page): the three add up to the prompt.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from radixserve.engine.outputs import RequestOutput
from radixserve.services.gateway.openai_api.choices import Choice
from radixserve.services.gateway.server.streaming import typed_sse

T = TypeVar("T")


PING = typed_sse({"type": "ping"})


def message_usage(last: RequestOutput, page_size: int) -> dict[str, int]:
    """The usage of a generation whose latest output is `last` (``page_size``: tokens a
    cached page holds; 0 where nothing is cached)."""
    prompt = last.prompt_tokens
    read = min(last.cached.total, prompt)
    kept = prompt // page_size * page_size if page_size > 0 else 0
    created = max(0, kept - read)
    return {
        "input_tokens": prompt - read - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": read,
        "output_tokens": last.completion_tokens,
    }


def stop_of(
    c: Choice, stops: Sequence[str], decode: Callable[[list[int]], str]
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice. A stop string is cut from the
    text, so the one that ended it is the earliest in the decoded tokens."""
    if c.tools is not None and c.tools.calls and c.tools.complete:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.finish_reason == "stop" and stops:
        text = decode(c.token_ids)
        found = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
        if found:
            return "stop_sequence", min(found)[2]
    return "end_turn", None


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}  # a streamed call cut short: its fragments went out as they were
    return value if isinstance(value, dict) else {}


class MessageBuilder:
    """One message (``body``: the skeleton, then its content as it comes) and the
    events that stream it. With `omit_thinking` (``thinking.display`` ``omitted``) a
    thinking block still opens and closes where the reasoning is, its ``thinking`` empty
    and no ``thinking_delta`` sent."""

    def __init__(self, body: dict[str, Any], omit_thinking: bool = False) -> None:
        self.body = body
        self.omit_thinking = omit_thinking
        self.started = False
        self._open: dict[str, Any] | None = None  # the open content block
        self._parts: list[str] = []  # its text, thinking or partial JSON so far

    def opening(self, usage: dict[str, int]) -> list[dict[str, Any]]:
        self.started = True
        self.body["usage"] = usage
        return [{"type": "message_start", "message": copy.deepcopy(self.body)}, {"type": "ping"}]

    def feed(self, deltas: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events for a choice's new message deltas."""
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._add("thinking", delta["reasoning_content"])
            if delta.get("content"):
                events += self._add("text", delta["content"])
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                if "id" in call:  # a call's opening delta: its id and name
                    events += self._close()
                    events += self._start({"type": "tool_use", "id": call["id"],
                                           "name": function["name"], "input": {}})  # fmt: skip
                if function.get("arguments"):
                    events += self._delta("input_json_delta", "partial_json",
                                          function["arguments"])  # fmt: skip
        return events

    def finish(
        self, stop_reason: str, stop_sequence: str | None, usage: dict[str, int]
    ) -> list[dict[str, Any]]:
        """The closing events; the body then is the final message."""
        events = self._close()
        self.body.update(stop_reason=stop_reason, stop_sequence=stop_sequence, usage=usage)
        events.append({"type": "message_delta", "usage": dict(usage),
                       "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}})  # fmt: skip
        events.append({"type": "message_stop"})
        return events

    def _add(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            block = {"type": "text", "text": ""} if kind == "text" else {
                "type": "thinking", "thinking": "", "signature": ""}  # fmt: skip
            events += self._start(block)
        if kind == "thinking" and self.omit_thinking:
            return events
        return events + self._delta(f"{kind}_delta", kind, text)

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self._open, self._parts = block, []
        self.body["content"].append(block)
        return [{"type": "content_block_start", "index": len(self.body["content"]) - 1,
                 "content_block": copy.deepcopy(block)}]  # fmt: skip

    def _delta(self, kind: str, field: str, piece: str) -> list[dict[str, Any]]:
        assert self._open is not None
        self._parts.append(piece)
        return [{"type": "content_block_delta", "index": len(self.body["content"]) - 1,
                 "delta": {"type": kind, field: piece}}]  # fmt: skip

    def _close(self) -> list[dict[str, Any]]:
        """The event that ends the open block, if any; the block gets its whole value."""
        block = self._open
        if block is None:
            return []
        whole = "".join(self._parts)
        if block["type"] == "tool_use":
            block["input"] = _input(whole)
        else:
            block[block["type"]] = whole
        self._open, self._parts = None, []
        return [{"type": "content_block_stop", "index": len(self.body["content"]) - 1}]


async def with_pings(source: AsyncIterator[T], interval_s: float) -> AsyncIterator[T | None]:
    """The items of `source`, with None after every `interval_s` that brought none
    (the caller sends a ping). Closing it cancels the pending read of `source`."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            read, pending = pending, None
            try:
                item = read.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
