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


def failure(
    exc: Exception, where: str = "in the gateway"
) -> tuple[int, str, str | None, dict[str, str] | None]:
    """(status, message, param, headers) of a failed request: a request's own fault is a
    400 (404 for a LoRA adapter no engine serves), no worker to serve it a 503; an
    unexpected exception is logged (``where``: where it escaped) and is a 500."""
    if isinstance(exc, OpenAIError):
        return exc.status, exc.message, exc.param, exc.headers
    if isinstance(exc, RequestError):
        status = 404 if isinstance(exc, UnknownAdapterError) else 400
        return status, str(exc), getattr(exc, "param", None), None
    if isinstance(exc, UnavailableError):
        return 503, str(exc), None, retry_after()
    if isinstance(exc, ValidationError | RequestValidationError):
        message, param = describe(exc.errors())
        return 400, message, param, None
    logger.exception("unhandled error %s", where, exc_info=exc)
    return 500, "internal server error", None, None


async def _failed(_: Request, exc: Exception) -> JSONResponse:
    return error_response(*failure(exc))


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    return error_response(exc.status_code, message)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type the gateway can meet to an OpenAI error object."""
    for kind in (
        OpenAIError,
        RequestError,
        UnavailableError,
        RequestValidationError,
        ValidationError,
        Exception,
    ):
        app.add_exception_handler(kind, _failed)
    app.add_exception_handler(StarletteHTTPException, _http_error)


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
