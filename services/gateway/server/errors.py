"""OpenAI error objects and the handlers that turn every failure into one.

Contract: every error reply of the gateway is JSON ``{"error": {"message", "type",
"param", "code"}}`` with the HTTP status in ``code`` (`ErrorResponse` documents it). Request-level failures are 4xx;
an unexpected exception is logged and becomes a 500 (the server keeps serving).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.errors import RequestError, UnavailableError, UnknownAdapterError
from radixserve.services.gateway.server.field_errors import describe
from radixserve.services.gateway.server.openapi import DocModel

logger = logging.getLogger(__name__)

_M = TypeVar("_M", bound=BaseModel)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """A request failure to report as an OpenAI error object with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """The OpenAI error object for `status`."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """A JSONResponse carrying `error_body`."""
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


#: seconds a refused client should wait before it tries again (429 and 503 say so)
RETRY_AFTER_S = 1


def retry_after() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def validated(model: type[_M], raw: Any, where: str = "") -> _M:
    """``raw`` as ``model``, or a 400 naming the field it fails on (``where``: the path
    ``raw`` sits at in the body)."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        message, param = describe(exc.errors(), where)
        raise OpenAIError(400, message, param) from None


async def _openai_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return error_response(exc.status, exc.message, exc.param, exc.headers)


def request_status(exc: RequestError) -> int:
    """A request's own fault: 404 for a LoRA adapter no engine serves, else 400."""
    return 404 if isinstance(exc, UnknownAdapterError) else 400


async def _request_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestError)
    return error_response(request_status(exc), str(exc), getattr(exc, "param", None))


async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
    return error_response(503, str(exc), headers=retry_after())


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ValidationError | RequestValidationError)
    message, param = describe(exc.errors())
    return error_response(400, message, param)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    return error_response(exc.status_code, message)


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in the gateway", exc_info=exc)
    return error_response(500, "internal server error")


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type the gateway can meet to an OpenAI error object."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(UnavailableError, _unavailable)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


# -- the documented error responses (/openapi.json) ------------------------------


class ErrorDetail(DocModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(DocModel):
    error: ErrorDetail


ERRORS: dict[int | str, dict[str, Any]] = {
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
AUTH_ERROR: dict[int | str, dict[str, Any]] = {401: ERRORS[401]}
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
    **ERRORS,
}
