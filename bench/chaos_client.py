"""One chat request of the chaos benchmark and how it ended, judged as a client sees it.

`send_chat` posts one greedy ``/v1/chat/completions`` (streamed or not) and fills a
`RequestRecord` with what came back. Outcomes:

    ok         HTTP 200 and a whole answer: a JSON body with a choice and a finish reason,
               or an SSE stream of chunks, a finish reason, usage and ``data: [DONE]``
    error      a clean error: an HTTP 4xx/5xx whose body is an OpenAI error object, or an
               SSE ``{"error": {...}}`` event followed by ``data: [DONE]``
    unclean    anything else: the connection reset or closed without an error object, a
               body or event that is not the API's shape, a stream without ``[DONE]`` or
               without a finish reason, text after the finish reason
    hang       no byte for ``hang_s`` (no progress): the request is abandoned
    dropped    the client itself hung up mid-stream (the benchmark's client-drop event)

Whether the text is right is decided later, against the reference (`chaos_report`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

OUTCOMES = ("ok", "error", "unclean", "hang", "dropped")


@dataclass
class RequestRecord:
    """One request: what was sent and, once it ends, what came back (times in seconds
    since the load started)."""

    request_id: int
    conversation: int
    turn: int
    stream: bool
    messages: list[dict[str, str]]
    prompt_ids: list[int]
    max_tokens: int
    started_s: float = 0.0
    ended_s: float | None = None
    first_text_s: float | None = None
    outcome: str | None = None  # one of OUTCOMES, None while running
    status: int | None = None  # HTTP status
    error: dict[str, Any] | None = None  # the OpenAI error object, for clean errors
    detail: str = ""  # what was wrong, for unclean ones
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    drop: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def summary(self) -> dict[str, Any]:
        """The record as JSON (messages left out: the prompt ids' length says enough)."""
        keys = ("request_id", "conversation", "turn", "stream", "max_tokens", "started_s",
                "ended_s", "first_text_s", "outcome", "status", "error", "detail",
                "finish_reason", "prompt_tokens", "completion_tokens")  # fmt: skip
        out = {k: getattr(self, k) for k in keys}
        out["prompt_len"] = len(self.prompt_ids)
        out["text_chars"] = len(self.text)
        return out


class _Unclean(Exception):
    """The reply broke the API's contract (see the module doc)."""


def _error_object(body: Any) -> dict[str, Any] | None:
    """The OpenAI error object in ``body``, or None if it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return None
    error = body["error"]
    if not isinstance(error.get("message"), str) or not isinstance(error.get("type"), str):
        return None
    return error


async def send_chat(
    http: httpx.AsyncClient, record: RequestRecord, hang_s: float, clock: Any
) -> None:
    """Send ``record``'s request and fill in how it ended; never raises for what the
    server does. ``clock()`` is the load's time in seconds."""
    body: dict[str, Any] = {
        "model": "default",
        "messages": record.messages,
        "max_tokens": record.max_tokens,
        "temperature": 0,
    }
    if record.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    record.started_s = clock()
    timeout = httpx.Timeout(hang_s, connect=hang_s)
    try:
        if record.stream:
            await _stream(http, body, record, timeout, clock)
        else:
            await _whole(http, body, record, timeout)
    except httpx.TimeoutException as exc:
        record.outcome = "hang"
        record.detail = f"no progress for {hang_s:g} s ({type(exc).__name__})"
    except _Unclean as exc:
        record.outcome, record.detail = "unclean", str(exc)
    except (httpx.TransportError, httpx.DecodingError) as exc:
        record.outcome, record.detail = "unclean", f"{type(exc).__name__}: {exc}"
    record.ended_s = clock()


def _refused(record: RequestRecord, status: int, raw: bytes) -> None:
    """An HTTP error status: clean with an OpenAI error object, unclean without."""
    record.status = status
    try:
        error = _error_object(json.loads(raw))
    except ValueError:
        error = None
    if error is None:
        raise _Unclean(f"HTTP {status} without an OpenAI error object: {raw[:200]!r}")
    record.outcome, record.error = "error", error


async def _whole(
    http: httpx.AsyncClient, body: dict[str, Any], record: RequestRecord, timeout: httpx.Timeout
) -> None:
    resp = await http.post("/v1/chat/completions", json=body, timeout=timeout)
    if resp.status_code != 200:
        _refused(record, resp.status_code, resp.content)
        return
    record.status = 200
    try:
        doc = resp.json()
        choice = doc["choices"][0]
        record.text = choice["message"]["content"] or ""
        record.finish_reason = choice["finish_reason"]
        record.prompt_tokens = doc["usage"]["prompt_tokens"]
        record.completion_tokens = doc["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise _Unclean(f"a 200 body that is not a chat completion: {exc!r}") from None
    if not record.finish_reason:
        raise _Unclean("a 200 body without a finish reason")
    record.outcome = "ok"


async def _stream(
    http: httpx.AsyncClient,
    body: dict[str, Any],
    record: RequestRecord,
    timeout: httpx.Timeout,
    clock: Any,
) -> None:
    async with http.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            _refused(record, resp.status_code, await resp.aread())
            return
        record.status = 200
        done = False
        async for line in resp.aiter_lines():
            if not line or line.startswith(":"):
                continue
            if done:
                raise _Unclean(f"data after [DONE]: {line[:200]!r}")
            if line == "data: [DONE]":
                done = True
                continue
            if not line.startswith("data: "):
                raise _Unclean(f"not an SSE data line: {line[:200]!r}")
            _event(record, line[6:], clock)
            if record.text and record.drop.is_set():
                record.outcome = "dropped"
                return  # leaving the block closes the connection mid-stream
    if not done:
        raise _Unclean("the stream ended without data: [DONE]")
    if record.outcome == "error":
        return
    if record.finish_reason is None:
        raise _Unclean("the stream ended without a finish reason or an error event")
    if record.completion_tokens is None:
        raise _Unclean("the stream ended without usage (stream_options.include_usage)")
    record.outcome = "ok"


def _event(record: RequestRecord, data: str, clock: Any) -> None:
    """Apply one SSE event to ``record``."""
    try:
        event = json.loads(data)
    except ValueError:
        raise _Unclean(f"an SSE event that is not JSON: {data[:200]!r}") from None
    if record.outcome == "error":
        raise _Unclean(f"an event after the error event: {data[:200]!r}")
    if "error" in event:
        error = _error_object(event)
        if error is None:
            raise _Unclean(f"an error event without an OpenAI error object: {data[:200]!r}")
        record.outcome, record.error = "error", error
        return
    usage = event.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
    for choice in event.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            if record.finish_reason is not None:
                raise _Unclean(f"text after the finish reason: {content[:100]!r}")
            if record.first_text_s is None:
                record.first_text_s = clock()
            record.text += content
        if choice.get("finish_reason"):
            if record.finish_reason is not None:
                raise _Unclean("a second finish reason")
            record.finish_reason = choice["finish_reason"]


def load_clock() -> Any:
    """A clock reading seconds since this call."""
    t0 = time.monotonic()
    return lambda: time.monotonic() - t0
