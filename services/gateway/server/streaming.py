"""A generation's HTTP responses: server-sent events, a streamed response that always
closes its engine streams, and the wait for a non-streamed reply that aborts it when
the client leaves."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.services.gateway.openai_api.choices import ChoiceBook, ClientGone, Generation

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # the client closed the connection (nginx's convention); never seen


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def typed_sse(event: dict[str, Any]) -> str:
    """An event named by its type, as the Responses API and Anthropic's Messages API
    send them."""
    return f"event: {event['type']}\n{sse(event)}"


async def _until_disconnect(request: Request, gen: Generation) -> None:
    """Wait for the client to close its connection (its body was read: nothing else
    arrives), then end ``gen`` with `ClientGone`."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gen.end("disconnected", ClientGone())


async def collect(
    request: Request, gen: Generation, book: ChoiceBook, close: Callable[[], Awaitable[None]]
) -> bool:
    """Every output of a non-streamed request into `book`; then `close`. False if the
    client left first (the request is then aborted)."""
    watch = asyncio.ensure_future(_until_disconnect(request, gen))
    try:
        async for job, out in gen.outputs():
            gen.observe(job, out)
            book.add(job, out)
        return True
    except ClientGone:
        logger.info("client left before the reply; aborted")
        return False
    finally:
        watch.cancel()
        await close()


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close` when it is done, however it ends
    (finished, client gone, cancelled), so the engine streams are never left open."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            body = self.body_iterator
            if hasattr(body, "aclose"):
                await body.aclose()
            await self._on_close()
