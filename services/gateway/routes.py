"""The gateway's routes, registered one way: `ROUTES`, one row per route (path, method,
handler, response model, request body, documented errors, traced), laid out on the app
by `create_app`. A route with a response model is documented in /openapi.json; a
traced one gets a span per request (`server.request_tracing`). The handlers live with
their concept: OpenAI's completions and token routes (`openai_api`), the Responses API
(`responses_api`), Anthropic's Messages API (`messages`), the operator's routes (`ops`)
and the traces (`server.request_tracing`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from radixserve.runtime.engine_client import EngineClient
from radixserve.services.gateway.gateway import Gateway
from radixserve.services.gateway.messages import request as message_bodies
from radixserve.services.gateway.messages import routes as messages
from radixserve.services.gateway.openai_api import adapters, bodies, schemas
from radixserve.services.gateway.openai_api import routes as openai
from radixserve.services.gateway.ops import explorer, status
from radixserve.services.gateway.responses_api import output
from radixserve.services.gateway.responses_api import routes as responses
from radixserve.services.gateway.responses_api.request import ResponsesRequest
from radixserve.services.gateway.server import errors, request_tracing
from radixserve.services.gateway.server.openapi import body, install_openapi
from radixserve.services.gateway.settings import GatewaySettings

Errors = dict[int | str, dict[str, Any]]
STORED_ERRORS: Errors = {code: errors.ERRORS[code] for code in (400, 401, 404)}


@dataclass(frozen=True)
class Route:
    """One route. ``response``: its model in /openapi.json (None: left out of it);
    ``request``: its JSON body's model, or the `openapi_extra` of its path and query
    parameters; ``errors``: its documented error responses; ``traced``: a span per
    request."""

    path: str
    method: str
    handler: Callable[..., Awaitable[Any]]
    response: type[BaseModel] | None = None
    request: type[BaseModel] | dict[str, Any] | None = None
    errors: Errors | None = None
    traced: bool = False


ROUTES = (
    Route("/v1/completions", "POST", openai.completions, bodies.CompletionResponse,
          schemas.CompletionRequest, errors.GENERATION_RESPONSES, traced=True),
    Route("/v1/chat/completions", "POST", openai.chat_completions,
          bodies.ChatCompletionResponse, schemas.ChatCompletionRequest, errors.GENERATION_RESPONSES,
          traced=True),
    Route("/v1/responses", "POST", responses.create_response, output.ResponseObject,
          ResponsesRequest, errors.GENERATION_RESPONSES, traced=True),
    Route("/v1/responses/{response_id}", "GET", responses.get_response, output.ResponseObject,
          responses.RESPONSE_ID, STORED_ERRORS),
    Route("/v1/responses/{response_id}", "DELETE", responses.delete_response,
          output.ResponseDeleted, responses.RESPONSE_ID, STORED_ERRORS),
    Route("/v1/responses/{response_id}/input_items", "GET", responses.input_items,
          output.ResponseItemList, responses.ITEM_PARAMETERS, STORED_ERRORS),
    Route("/v1/messages", "POST", messages.create_message, messages.MessageResponse,
          message_bodies.MessagesRequest, messages.MESSAGES_RESPONSES, traced=True),
    Route("/v1/messages/count_tokens", "POST", messages.count_tokens, messages.TokenCount,
          message_bodies.CountTokensRequest, messages.MESSAGES_ERRORS),
    Route("/v1/models", "GET", openai.models, bodies.ModelList, None, errors.AUTH_ERROR),
    Route("/v1/load_lora_adapter", "POST", adapters.load_lora_adapter, None,
          adapters.LoadLoraAdapterRequest, errors.ERRORS),
    Route("/v1/unload_lora_adapter", "POST", adapters.unload_lora_adapter, None,
          adapters.UnloadLoraAdapterRequest, errors.ERRORS),
    Route("/tokenize", "POST", openai.tokenize, bodies.TokenizeResponse, schemas.TokenizeRequest,
          errors.ERRORS),
    Route("/detokenize", "POST", openai.detokenize, bodies.DetokenizeResponse,
          schemas.DetokenizeRequest, errors.ERRORS),
    Route("/version", "GET", openai.version_route, bodies.VersionResponse),
    Route("/health", "GET", status.health),
    Route("/live", "GET", status.live),
    Route("/metrics", "GET", status.metrics_text),
    Route("/debug/cache", "GET", status.debug_cache),
    Route("/debug/cache/audit/clear", "POST", status.clear_cache_audit),
    Route("/explorer", "GET", explorer.page),
    Route("/debug/explorer/workers", "GET", explorer.workers),
    Route("/debug/explorer/tree", "GET", explorer.tree),
    Route("/debug/explorer/requests", "GET", explorer.requests),
    Route("/debug/explorer/autoscaler", "GET", explorer.autoscaler),
    Route("/debug/traces", "GET", request_tracing.debug_traces),
    Route("/debug/traces/{trace_id}", "GET", request_tracing.debug_trace),
)  # fmt: skip


def create_app(client: EngineClient, settings: GatewaySettings | None = None) -> FastAPI:
    """The gateway app over `client`. The caller owns `client` (and closes it)."""
    gw = Gateway(client, settings or GatewaySettings())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await client.start()
        try:
            yield
        finally:
            await client.shutdown()
            gw.preparer.close()
            tracer.close()  # posts the spans still queued for the OTLP collector

    app = FastAPI(
        title="radixserve gateway",
        description="OpenAI-compatible API of radixserve.",
        version=openai.version(),
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,
    )
    errors.install_error_handlers(app)
    for route in ROUTES:  # an undocumented route's response model is FastAPI's default
        extra = body(route.request) if isinstance(route.request, type) else route.request
        documented = dict(
            response_model=route.response, responses=route.errors, openapi_extra=extra
        )
        options = documented if route.response is not None else {"include_in_schema": False}
        app.add_api_route(route.path, route.handler, methods=[route.method], **options)  # fmt: skip
    traced = frozenset(route.path for route in ROUTES if route.traced)
    tracer = request_tracing.install_tracing(app, gw.settings, traced)
    install_openapi(app)
    app.state.gateway = gw
    return app
