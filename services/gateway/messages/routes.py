"""Anthropic's Messages API on the gateway: ``POST /v1/messages`` (streamed or not) and
``POST /v1/messages/count_tokens``, so Anthropic's SDK and Claude Code work unchanged
(``ANTHROPIC_BASE_URL=http://host:port``).

A request runs on the chat path (`request`): it is admitted, charged, traced,
logged and metered as a chat completion (`Gateway.start`), its reply's deltas are
the chat choice's (`choices.reply_deltas`: text, tool-call argument fragments,
reasoning), translated into Anthropic's blocks and events (`output`). The key
may come as ``x-api-key`` (Anthropic's header) or ``Authorization: Bearer``;
``anthropic-version`` and ``anthropic-beta`` are accepted and not read.

Errors on these two routes are Anthropic's objects, ``{"type": "error", "error":
{"type", "message"}}``, the message naming the field at fault. An admission refusal
for load (the cluster's or the tenant's share of it) and an unavailable cluster answer
529 ``overloaded_error``, and a tenant over its rates 429 ``rate_limit_error``: both
are retried by Anthropic's clients with backoff.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from radixserve.services.gateway.gateway import Gateway, gateway_of
from radixserve.services.gateway.messages.output import (
    PING,
    MessageBuilder,
    message_usage,
    stop_of,
    with_pings,
)
from radixserve.services.gateway.messages.plan import count_prompt, messages_plan
from radixserve.services.gateway.messages.request import CountTokensRequest, MessagesRequest
from radixserve.services.gateway.openai_api.choices import ChoiceBook, Generation, reply_deltas
from radixserve.services.gateway.responses_api.output import new_id
from radixserve.services.gateway.server.errors import failure, retry_after
from radixserve.services.gateway.server.openapi import DocModel
from radixserve.services.gateway.server.streaming import (
    CLIENT_CLOSED,
    ClosingStreamingResponse,
    collect,
    typed_sse,
)
from radixserve.services.gateway.tenancy.admission import Refused

OVERLOADED = 529  # Anthropic's status for an overloaded API: its clients back off and retry
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    OVERLOADED: "overloaded_error",
}
_RATE_REASONS = ("requests_per_minute", "tokens_per_minute")  # `admission` refusal reasons


def error_object(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _failure(exc: Exception) -> tuple[int, str, dict[str, str] | None]:
    """(status, message naming the field at fault, headers) of a failed request: the
    gateway's (`errors.failure`), with Anthropic's status for an overloaded API."""
    status, message, param, headers = failure(exc, "on /v1/messages")
    if status == 503 or (isinstance(exc, Refused) and status == 429
                         and exc.reason not in _RATE_REASONS):  # fmt: skip
        status, headers = OVERLOADED, headers or retry_after()
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return status, message, headers


def anthropic_errors(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """`handler` with every failure answered as Anthropic's error object."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            status, message, headers = _failure(exc)
            return JSONResponse(error_object(status, message), status, headers=headers)

    return wrapped


@anthropic_errors
async def count_tokens(request: Request) -> Response:
    gw = gateway_of(request)
    req = CountTokensRequest.checked(await gw.read_json(request))
    await gw.check_model(req.model)
    count = await count_prompt(req, gw.client, gw.tool_format, gw.reasoning_format, gw.limits,
                               gw.preparer.begin())  # fmt: skip
    return JSONResponse({"input_tokens": count})


class _Reply:
    """What finishing a reply needs: its builder, choices and how to read its stop."""

    def __init__(self, gw: Gateway, req: MessagesRequest, gen: Generation, book: ChoiceBook,
                 builder: MessageBuilder) -> None:  # fmt: skip
        self.gen, self.book, self.builder = gen, book, builder
        self.stops = tuple(req.stop_sequences or ())
        self.decode = gw.client.tokenizer.decode
        self.page_size = gw.client.cache_page_size

    def usage(self) -> dict[str, int]:
        return message_usage(self.gen.total(0), self.page_size)

    def rejected(self) -> str | None:
        """Why the parser rejected a tool call the stream had opened (None: it did not)."""
        tools = self.book.choices[(0, 0)].tools
        if tools is None or tools.error is None:
            return None
        return f"tool call rejected: {tools.error}"

    def finish(self) -> list[dict[str, Any]]:
        c = self.book.choices[(0, 0)]
        reason, sequence = stop_of(c, self.stops, self.decode)
        return self.builder.finish(reason, sequence, self.usage())


@anthropic_errors
async def create_message(request: Request) -> Response:
    arrived = time.monotonic()
    gw = gateway_of(request)
    req = MessagesRequest.checked(await gw.read_json(request))
    adapter = await gw.check_model(req.model)
    deadline = gw.deadline(request, None, arrived)  # X-Request-Timeout
    plan = await messages_plan(req, gw.client, gw.tool_format, gw.reasoning_format, gw.limits,
                               gw.preparer.begin())  # fmt: skip
    mid = new_id("msg")
    started = await gw.start(request, plan, mid, deadline, adapter)  # admission, tenant, trace, log
    if started is None:
        return Response(status_code=CLIENT_CLOSED)
    gen, close = started
    omit = req.thinking is not None and req.thinking.display == "omitted"
    builder = MessageBuilder({"id": mid, "type": "message", "role": "assistant",
                              "model": gw.served_as(adapter), "content": [], "stop_reason": None,
                              "stop_sequence": None, "usage": {}}, omit)  # fmt: skip
    reply = _Reply(gw, req, gen, ChoiceBook(plan, gw.formatter), builder)
    if plan.stream:
        interval = gw.settings.stream_ping_interval_s
        return ClosingStreamingResponse(_events(reply, interval), close)
    if not await collect(request, gen, reply.book, close):
        return Response(status_code=CLIENT_CLOSED)
    c = reply.book.choices[(0, 0)]
    builder.feed(reply_deltas(c, "".join(c.text), finished=True))
    reply.finish()
    return JSONResponse(builder.body)


async def _events(reply: _Reply, ping_interval_s: float) -> AsyncIterator[str]:
    """The events of a streamed reply (see `output`)."""
    gen, builder = reply.gen, reply.builder
    outputs = with_pings(gen.outputs(), ping_interval_s)
    try:
        async for item in outputs:
            if item is None:
                yield PING
                continue
            job, out = item
            gen.observe(job, out)
            c = reply.book.add(job, out)
            if not builder.started:
                for event in builder.opening(reply.usage()):
                    yield typed_sse(event)
            for event in builder.feed(reply_deltas(c, out.new_text, out.finish_reason is not None)):
                yield typed_sse(event)
        rejected = reply.rejected()
        if rejected is not None:  # a tool_use block went out that the parser then rejected:
            # no stop reason presents it as a finished call
            yield typed_sse(error_object(500, rejected))
            return
        for event in reply.finish():
            yield typed_sse(event)
    except Exception as exc:  # an engine failure mid-stream, or the gateway's end of it
        # (its deadline, a slow client): tell the client, then end
        status, message, _ = _failure(exc)
        if status == 500:
            message = f"generation failed: {exc}"
        yield typed_sse(error_object(status, message))
    finally:
        await outputs.aclose()


# -- models for /openapi.json ---------------------------------------------------------


class AnthropicErrorDetail(DocModel):
    type: str
    message: str


class AnthropicError(DocModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageUsage(DocModel):
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


class TextOut(DocModel):
    type: Literal["text"]
    text: str


class ThinkingOut(DocModel):
    type: Literal["thinking"]
    thinking: str
    signature: str


class ToolUseOut(DocModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageResponse(DocModel):
    """A Messages API reply (``POST /v1/messages``)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[TextOut | ThinkingOut | ToolUseOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(DocModel):
    input_tokens: int


MESSAGES_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicError, "description": text}
    for status, text in (
        (400, "invalid request (the message names the field)"),
        (401, "missing or wrong API key (x-api-key or Authorization: Bearer)"),
        (403, "the API key may not ask for this priority"),
        (404, "unknown model"),
        (408, "the body did not arrive in time, or the request's deadline passed"),
        (413, "body too large"),
        (429, "the tenant is over its rate limits"),
        (OVERLOADED, "overloaded: too much in flight, or no worker can serve"),
    )
}
MESSAGES_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {"schema": {
            "type": "object", "properties": {"event": {"type": "string"},
                                             "data": {"type": "string"}},
            "required": ["event", "data"]}}},
        "description": "the message; with `stream`, Anthropic's server-sent events",
    },
    **MESSAGES_ERRORS,
}  # fmt: skip
