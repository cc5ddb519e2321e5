"""The gateway's discovery and token routes: GET /v1/models, POST /tokenize and
/detokenize (vLLM's shapes), GET /version; and the documented error responses."""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from radixserve.errors import InvalidRequestError
from radixserve.services.gateway.openapi import body
from radixserve.services.gateway.responses import (
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from radixserve.services.gateway.schemas import DetokenizeRequest, TokenizeRequest

if TYPE_CHECKING:
    from radixserve.services.gateway.app import _Gateway

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (400, "invalid request (the field is named in `error.param`)"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "body too large"),
        (429, "too many requests in flight"),
        (503, "no worker can serve"),
    )
}
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
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


def install(app: FastAPI, gw: _Gateway) -> None:
    async def models(request: Request) -> dict[str, Any]:
        gw.authorize(request)
        cards = [
            {"id": name, "object": "model", "created": 0, "owned_by": "radixserve",
             "max_model_len": gw.client.max_model_len, "root": gw.client.model_name}
            for name in gw.model_names
        ]  # fmt: skip
        return {"object": "list", "data": cards}

    async def tokenize(request: Request) -> dict[str, Any]:
        gw.authorize(request)
        req = TokenizeRequest.model_validate(await gw.read_json(request))
        gw.check_model(req.model)
        tokenizer = gw.client.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            messages = [m.to_template() for m in req.messages]
            text = tokenizer.apply_chat_template(messages, bool(req.add_generation_prompt))
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(
                req.prompt or "", add_special_tokens=bool(req.add_special_tokens)
            )
        strs = [gw.formatter.text(t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": gw.client.max_model_len, "tokens": ids,
                "token_strs": strs}  # fmt: skip

    async def detokenize(request: Request) -> dict[str, Any]:
        gw.authorize(request)
        req = DetokenizeRequest.model_validate(await gw.read_json(request))
        gw.check_model(req.model)
        vocab = gw.client.tokenizer.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens"
            )
        return {"prompt": gw.client.tokenizer.decode(req.tokens)}

    async def version_route() -> dict[str, str]:
        return {"version": version()}

    app.add_api_route(
        "/v1/models",
        models,
        methods=["GET"],
        response_model=ModelList,
        responses={401: _ERRORS[401]},
    )
    app.add_api_route(
        "/tokenize",
        tokenize,
        methods=["POST"],
        response_model=TokenizeResponse,
        responses=_ERRORS,
        openapi_extra=body(TokenizeRequest),
    )
    app.add_api_route(
        "/detokenize",
        detokenize,
        methods=["POST"],
        response_model=DetokenizeResponse,
        responses=_ERRORS,
        openapi_extra=body(DetokenizeRequest),
    )
    app.add_api_route("/version", version_route, methods=["GET"], response_model=VersionResponse)
    # fmt: skip
