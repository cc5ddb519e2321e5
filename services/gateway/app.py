"""The OpenAI-compatible HTTP gateway: `create_app(client, settings) -> FastAPI`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream or not), GET
/v1/models, GET /health (ready: a decode worker, or the in-process engine, can serve),
GET /live (the process answers), GET /metrics, GET /debug/cache. Contracts:

* every error is an OpenAI error object (see `errors`); bad input never crashes it;
* at most `settings.max_queued_requests` generations are in flight; one more is refused
  at once with 429 (nothing waits);
* a streaming client that disconnects has its request aborted in the engine: the
  response closes the engine stream whatever way it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.engine.outputs import RequestOutput
from radixserve.engine.sampling_params import SamplingParams
from radixserve.metrics import CONTENT_TYPE, RequestTimer, ServingMetrics
from radixserve.services.gateway.engine_client import EngineClient
from radixserve.services.gateway.errors import OpenAIError, error_body, install_error_handlers
from radixserve.services.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    Kind,
    full_response,
    stream_chunk,
    usage_chunk,
)
from radixserve.services.gateway.settings import GatewaySettings

logger = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_DISCONNECT_POLL_S = 0.25  # how often a request waiting for its first token checks the client
_CLIENT_CLOSED = 499  # the client closed the connection (nginx's convention); never seen


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close` when it is done, however it ends
    (finished, client gone, cancelled), so the engine stream is never left open."""

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


class _Generation:
    """One in-flight generation: its engine stream, timer and admission slot."""

    def __init__(self, gateway: _Gateway, stream: AsyncIterator[RequestOutput]) -> None:
        self.gateway = gateway
        self.stream = stream
        self.timer = RequestTimer(gateway.metrics)
        self.last: RequestOutput | None = None
        self._closed = False

    def observe(self, out: RequestOutput) -> None:
        self.last = out
        self.timer.tokens(len(out.new_token_ids))
        if out.finished:
            reason = out.finish_reason or "stop"
            self.timer.finish(out, reason)

    async def close(self) -> None:
        """Idempotent: abort the engine request if unfinished, count it, free the slot."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.stream.aclose()  # type: ignore[attr-defined]
        finally:
            last = self.last
            if last is not None and not last.finished:
                self.timer.finish(last, "abort")
            self.gateway.release()


class _Gateway:
    """State and handlers behind the routes."""

    def __init__(self, client: EngineClient, settings: GatewaySettings) -> None:
        self.client = client
        self.settings = settings
        self.metrics = ServingMetrics()
        self.model_name = settings.served_model_name or client.model_name
        self.in_flight = 0

    # -- admission, auth, body -------------------------------------------------------

    def acquire(self) -> None:
        if self.in_flight >= self.settings.max_queued_requests:
            raise OpenAIError(429, f"server busy: {self.in_flight} requests in flight")
        self.in_flight += 1
        self.metrics.queue_depth.set(self.in_flight)

    def release(self) -> None:
        self.in_flight -= 1
        self.metrics.queue_depth.set(self.in_flight)

    def authorize(self, request: Request) -> None:
        keys = self.settings.api_keys
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        ok = scheme.lower() == "bearer" and any(
            secrets.compare_digest(token.encode(), k.encode()) for k in keys
        )
        if not ok:
            raise OpenAIError(401, "missing or invalid API key (Authorization: Bearer <key>)")

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object: 413 over the size limit, 400 if not UTF-8 JSON."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise OpenAIError(413, f"request body over {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise OpenAIError(413, f"request body over {limit} bytes")
            chunks.append(chunk)
        try:
            text = b"".join(chunks).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise OpenAIError(400, f"request body is not valid UTF-8: {exc.reason}") from None
        try:
            body = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise OpenAIError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body must be a JSON object")
        return body

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, "default"):
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")

    # -- endpoints -------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        self.authorize(request)
        req = CompletionRequest.model_validate(await self.read_json(request))
        self.check_model(req.model)
        prompt_ids = self.client.encode_prompt(req.single_prompt())
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        params = req.sampling_params(max_tokens)
        return await self.generate(
            request, "completion", prompt_ids, params, req.stream, req.include_usage
        )

    async def chat_completions(self, request: Request) -> Response:
        self.authorize(request)
        req = ChatCompletionRequest.model_validate(await self.read_json(request))
        self.check_model(req.model)
        req.check_supported()
        prompt_ids = self.client.chat_prompt_ids(req.messages)
        max_tokens = req.requested_max_tokens
        if max_tokens is None:
            room = self.client.max_model_len - len(prompt_ids)
            max_tokens = max(1, min(self.settings.default_max_tokens, room))
        params = req.sampling_params(max_tokens)
        return await self.generate(
            request, "chat", prompt_ids, params, req.stream, req.include_usage
        )

    async def generate(
        self,
        request: Request,
        kind: Kind,
        prompt_ids: list[int],
        params: SamplingParams,
        stream: bool | None,
        include_usage: bool,
    ) -> Response:
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        self.acquire()
        gen = _Generation(self, self.client.generate(prompt_ids, params, rid))
        try:
            first = await self._first_output(request, gen)  # RequestError → 400, no byte sent
        except BaseException:
            await gen.close()
            raise
        if first is None:  # the client left before the first token (e.g. during prefill)
            await gen.close()
            return Response(status_code=_CLIENT_CLOSED)
        meta = (kind, rid, int(time.time()), self.model_name)
        if stream:
            events = self._events(meta, gen, first, include_usage)
            return _ClosingStreamingResponse(events, on_close=gen.close)
        try:
            text, out = [], first
            while True:
                gen.observe(out)
                text.append(out.new_text)
                if out.finished:
                    break
                out = await gen.stream.__anext__()
        finally:
            await gen.close()
        return JSONResponse(full_response(*meta, "".join(text), out))

    async def _first_output(self, request: Request, gen: _Generation) -> RequestOutput | None:
        """The stream's first output, or None if the client disconnects while waiting
        (the prefill of a long prompt can take seconds; nobody should wait for it)."""
        first = asyncio.ensure_future(gen.stream.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({first}, timeout=_DISCONNECT_POLL_S)
                if done:
                    return first.result()
                if await request.is_disconnected():
                    logger.info("client left before the first token; aborting")
                    return None
        finally:
            if not first.done():
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)

    async def _events(
        self,
        meta: tuple[Kind, str, int, str],
        gen: _Generation,
        out: RequestOutput,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        kind = meta[0]
        try:
            if kind == "chat":
                role = {"role": "assistant", "content": ""}
                yield _sse(stream_chunk(*meta, role, None, include_usage))
            while True:
                gen.observe(out)
                if out.new_text or out.finished:
                    delta: Any = out.new_text
                    if kind == "chat":
                        delta = {"content": out.new_text} if out.new_text else {}
                    reason = out.finish_reason if out.finished else None
                    yield _sse(stream_chunk(*meta, delta, reason, include_usage))
                if out.finished:
                    break
                out = await gen.stream.__anext__()
            if include_usage:
                yield _sse(usage_chunk(*meta, out))
        except Exception as exc:  # an engine failure mid-stream: tell the client, then end
            logger.exception("stream %s failed", meta[1])
            yield _sse(error_body(500, f"generation failed: {exc}"))
        yield "data: [DONE]\n\n"

    async def models(self, request: Request) -> dict[str, Any]:
        self.authorize(request)
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "radixserve",
            "max_model_len": self.client.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def health(self) -> JSONResponse:
        ok, detail = self.client.health()
        body = {"status": "ok" if ok else "unavailable", "model": self.model_name, **detail}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def live(self) -> dict[str, str]:
        return {"status": "alive"}

    async def metrics_text(self) -> Response:
        body = self.metrics.render(self.client.stats(), self.client.worker_stats())
        return Response(body, media_type=CONTENT_TYPE)

    async def debug_cache(self, request: Request) -> dict[str, Any]:
        self.authorize(request)
        body: dict[str, Any] = {**self.client.stats(), "gateway_in_flight": self.in_flight}
        workers = self.client.worker_stats()
        if workers:
            body["workers"] = workers
        return body


def create_app(client: EngineClient, settings: GatewaySettings | None = None) -> FastAPI:
    """The gateway app over `client`. The caller owns `client` (and closes it)."""
    gw = _Gateway(client, settings or GatewaySettings())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await client.start()
        try:
            yield
        finally:
            await client.shutdown()

    app = FastAPI(
        title="radixserve gateway",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.add_api_route("/v1/completions", gw.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", gw.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", gw.models, methods=["GET"])
    app.add_api_route("/health", gw.health, methods=["GET"])
    app.add_api_route("/live", gw.live, methods=["GET"])
    app.add_api_route("/metrics", gw.metrics_text, methods=["GET"])
    app.add_api_route("/debug/cache", gw.debug_cache, methods=["GET"])
    app.state.gateway = gw
    return app
