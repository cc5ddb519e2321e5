"""The gateway's route table (`create_app`): the OpenAI generation routes and the stored
responses of the Responses API (handled by `app.Gateway`; a stored response's input
items listed here), Anthropic's Messages API (`messages_api`), the discovery and token
routes defined here (GET /v1/models, POST /tokenize and /detokenize in vLLM's shapes,
GET /version), health, metrics, the cache view, and the documented error responses."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from functools import partial
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request

from radixserve.errors import InvalidRequestError
from radixserve.model.identity import identity_card
from radixserve.services.gateway.app import Gateway
from radixserve.services.gateway.engine_client import EngineClient
from radixserve.services.gateway.errors import OpenAIError, install_error_handlers
from radixserve.services.gateway.explorer import install_explorer
from radixserve.services.gateway.messages_api import (
    MESSAGES_ERRORS,
    MESSAGES_RESPONSES,
    MessageResponse,
    TokenCount,
    count_tokens,
    create_message,
)
from radixserve.services.gateway.messages_request import CountTokensRequest, MessagesRequest
from radixserve.services.gateway.openapi import body, install_openapi
from radixserve.services.gateway.query import int_param, only_params
from radixserve.services.gateway.request_tracing import install_tracing
from radixserve.services.gateway.response_request import ResponsesRequest
from radixserve.services.gateway.response_store import item_page
from radixserve.services.gateway.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    ResponseDeleted,
    ResponseItemList,
    ResponseObject,
    TokenizeResponse,
    VersionResponse,
)
from radixserve.services.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.gateway.tools import (
    CHAT_TOOLS,
    ToolRequest,
    check_tools,
    template_inputs,
)

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (400, "invalid request (the field is named in `error.param`)"),
        (401, "missing or wrong API key"),
        (404, "unknown model, or no stored response of that id"),
        (408, "the body did not arrive in time, or the request's deadline passed"),
        (413, "body too large"),
        (429, "too many requests in flight"),
        (503, "no worker can serve"),
    )
}
_AUTH_ERROR: dict[int | str, dict[str, Any]] = {401: _ERRORS[401]}
_STORED_ERRORS: dict[int | str, dict[str, Any]] = {
    status: _ERRORS[status] for status in (400, 401, 404)
}
#: the path parameter of a stored response's routes (their handlers read it themselves)
_RESPONSE_ID = {"parameters": [{"name": "response_id", "in": "path", "required": True,
                                "schema": {"type": "string", "minLength": 1}}]}  # fmt: skip
_ITEM_PARAMETERS = {"parameters": [
    *_RESPONSE_ID["parameters"],
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                "maximum": 100, "default": 20}},
    {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"], "default": "desc"}},
    {"name": "after", "in": "query", "schema": {"type": "string"},
     "description": "List the items after this item id (in `order`)."},
]}  # fmt: skip
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
        "description": "the response; with `stream`, server-sent events whose `data` is one "
        "chunk as JSON, the last `[DONE]`",
    },
    **_ERRORS,
}


def version() -> str:
    try:
        return metadata.version("radixserve")
    except metadata.PackageNotFoundError:
        from radixserve import __version__

        return __version__


def _gateway(request: Request) -> Gateway:
    """The `Gateway` of the app serving ``request``, authorized."""
    gw: Gateway = request.app.state.gateway
    gw.authorize(request)
    return gw


async def models(request: Request) -> dict[str, Any]:
    gw = _gateway(request)
    cards = [
        {"id": name, "object": "model", "created": 0, "owned_by": "radixserve",
         "max_model_len": gw.client.max_model_len, "root": gw.client.model_name,
         "identity": identity_card(gw.client.identity)}
        for name in gw.model_names
    ]  # fmt: skip
    return {"object": "list", "data": cards}


def _chat_ids(req: TokenizeRequest, tools: ToolRequest | None, gw: Gateway) -> list[int]:
    """The ids of the chat prompt /tokenize shows (CPU work: run in the `Preparer`)."""
    messages, kwargs = template_inputs(req, tools, gw.tool_format)
    text = gw.client.tokenizer.apply_chat_template(
        messages, bool(req.add_generation_prompt), **kwargs
    )
    return gw.client.tokenizer.encode(text, add_special_tokens=False)


async def tokenize(request: Request) -> dict[str, Any]:
    gw = _gateway(request)
    req = TokenizeRequest.model_validate(await gw.read_json(request))
    gw.check_model(req.model)
    tokenizer = gw.client.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        tools = check_tools(req.tools, None, None, False, CHAT_TOOLS, gw.limits)
        ids = await gw.preparer.begin().run("messages", _chat_ids, req, tools, gw)
    elif req.tools is not None:
        raise InvalidRequestError("tools are rendered by the chat template: give them with "
                                  "messages, not with prompt", param="tools")  # fmt: skip
    else:
        encode = partial(tokenizer.encode, req.prompt or "",
                         add_special_tokens=bool(req.add_special_tokens))  # fmt: skip
        ids = await gw.preparer.begin().run("prompt", encode)
    strs = [gw.formatter.text(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": gw.client.max_model_len, "tokens": ids,
            "token_strs": strs}  # fmt: skip


async def detokenize(request: Request) -> dict[str, Any]:
    gw = _gateway(request)
    req = DetokenizeRequest.model_validate(await gw.read_json(request))
    gw.check_model(req.model)
    vocab = gw.client.tokenizer.vocab_size
    bad = [t for t in req.tokens if t >= vocab]
    if bad:
        raise InvalidRequestError(
            f"tokens holds {bad[0]}, outside the vocabulary [0, {vocab})", param="tokens"
        )
    return {"prompt": gw.client.tokenizer.decode(req.tokens)}


_ITEM_QUERY = ("limit", "order", "after")


def _item_query(request: Request) -> tuple[int, str, str | None]:
    """(limit, order, after) of an input-item listing; 400 naming a bad parameter."""
    only_params(request, _ITEM_QUERY, "input items")
    limit = int_param(request, "limit", 20, 1, 100)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise OpenAIError(400, f'order must be "asc" or "desc", got {order!r}', "order")
    return limit, order, request.query_params.get("after")


async def input_items(request: Request) -> dict[str, Any]:
    """``GET /v1/responses/{response_id}/input_items``: the items a stored response was
    made from, newest first by default (OpenAI's list object)."""
    gw: Gateway = request.app.state.gateway
    principal = gw.authorize(request)
    limit, order, after = _item_query(request)
    turn = gw.responses.turn(str(request.path_params["response_id"]), "response_id", principal)
    return item_page(turn.inputs(), limit, order, after)


async def version_route() -> dict[str, str]:
    return {"version": version()}


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
        version=version(),
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    documented = (  # path, method, handler, response, request body (or path parameters), errors
        ("/v1/completions", "POST", gw.completions, CompletionResponse, CompletionRequest,
         GENERATION_RESPONSES),
        ("/v1/chat/completions", "POST", gw.chat_completions, ChatCompletionResponse,
         ChatCompletionRequest, GENERATION_RESPONSES),
        ("/v1/responses", "POST", gw.create_response, ResponseObject, ResponsesRequest,
         GENERATION_RESPONSES),
        ("/v1/responses/{response_id}", "GET", gw.get_response, ResponseObject, _RESPONSE_ID,
         _STORED_ERRORS),
        ("/v1/responses/{response_id}", "DELETE", gw.delete_response, ResponseDeleted,
         _RESPONSE_ID, _STORED_ERRORS),
        ("/v1/responses/{response_id}/input_items", "GET", input_items, ResponseItemList,
         _ITEM_PARAMETERS, _STORED_ERRORS),
        ("/v1/messages", "POST", create_message, MessageResponse, MessagesRequest,
         MESSAGES_RESPONSES),
        ("/v1/messages/count_tokens", "POST", count_tokens, TokenCount, CountTokensRequest,
         MESSAGES_ERRORS),
        ("/v1/models", "GET", models, ModelList, None, _AUTH_ERROR),
        ("/tokenize", "POST", tokenize, TokenizeResponse, TokenizeRequest, _ERRORS),
        ("/detokenize", "POST", detokenize, DetokenizeResponse, DetokenizeRequest, _ERRORS),
        ("/version", "GET", version_route, VersionResponse, None, None),
    )  # fmt: skip
    for path, method, handler, response, request, errors in documented:
        extra = body(request) if isinstance(request, type) else request
        app.add_api_route(path, handler, methods=[method], response_model=response,
                          responses=errors, openapi_extra=extra)  # fmt: skip
    for path, handler in (("/health", gw.health), ("/live", gw.live),
                          ("/metrics", gw.metrics_text), ("/debug/cache", gw.debug_cache)):  # fmt: skip
        app.add_api_route(path, handler, methods=["GET"], include_in_schema=False)
    app.add_api_route("/debug/cache/audit/clear", gw.clear_cache_audit, methods=["POST"],
                      include_in_schema=False)  # fmt: skip
    install_explorer(app, gw)
    tracer = install_tracing(app, gw.settings)
    install_openapi(app)
    app.state.gateway = gw
    return app
