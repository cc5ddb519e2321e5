"""The Responses API's routes: POST /v1/responses (streamed or not) and a stored
response's GET, DELETE and GET .../input_items. A request becomes a chat `Plan`
(`request`) after the conversation it continues (`store`); its reply becomes output
items and typed events (`output`)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from radixserve.services.gateway.gateway import Gateway, caller, gateway_of
from radixserve.services.gateway.openai_api.choices import ChoiceBook, Generation, reply_deltas
from radixserve.services.gateway.responses_api.output import ResponseBuilder, new_id, response_usage
from radixserve.services.gateway.responses_api.request import (
    ResponsesRequest,
    canonical,
    input_item,
    response_plan,
)
from radixserve.services.gateway.responses_api.store import Turn, item_page
from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.services.gateway.server.query import int_param, only_params
from radixserve.services.gateway.server.streaming import (
    CLIENT_CLOSED,
    ClosingStreamingResponse,
    collect,
    typed_sse,
)
from radixserve.services.gateway.tenancy.tenants import Principal

logger = logging.getLogger(__name__)

#: the path parameter of a stored response's routes (their handlers read it themselves)
RESPONSE_ID = {"parameters": [{"name": "response_id", "in": "path", "required": True,
                               "schema": {"type": "string", "minLength": 1}}]}  # fmt: skip
ITEM_PARAMETERS = {"parameters": [
    *RESPONSE_ID["parameters"],
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                "maximum": 100, "default": 20}},
    {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"], "default": "desc"}},
    {"name": "after", "in": "query", "schema": {"type": "string"},
     "description": "List the items after this item id (in `order`)."},
]}  # fmt: skip
_ITEM_QUERY = ("limit", "order", "after")


async def create_response(request: Request) -> Response:
    arrived = time.monotonic()
    gw = gateway_of(request)
    req = ResponsesRequest.checked(await gw.read_json(request))
    adapter = await gw.check_model(req.model)
    deadline = gw.deadline(request, req.timeout, arrived)
    parent = None
    if req.previous_response_id is not None:
        parent = gw.responses.turn(req.previous_response_id, "previous_response_id",
                                   caller(request))  # fmt: skip
    history = parent.conversation() if parent else []
    plan = await response_plan(req, history, gw.client, gw.settings.default_max_tokens,
                               gw.tool_format, gw.limits,
                               gw.preparer.begin(), gw.reasoning_format)  # fmt: skip
    rid = new_id("resp")
    started = await gw.start(request, plan, rid, deadline, adapter)
    if started is None:
        return Response(status_code=CLIENT_CLOSED)
    gen, close = started
    builder = ResponseBuilder({
        "id": rid, "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "background": False, "error": None,
        "incomplete_details": None, "model": gw.served_as(adapter), "output": [],
        "truncation": "disabled", "usage": None, **req.echo(),
    })  # fmt: skip
    book = ChoiceBook(plan, gw.formatter)
    if plan.stream:
        events = _response_events(gw, req, parent, builder, gen, book, caller(request))
        return ClosingStreamingResponse(events, close)
    if not await collect(request, gen, book, close):
        return Response(status_code=CLIENT_CLOSED)
    c = book.choices[(0, 0)]
    builder.feed(reply_deltas(c, "".join(c.text), finished=True))
    builder.finish(c.finish_reason, response_usage(gen.total(0)))
    _keep(gw, req, parent, builder.body, caller(request))
    return JSONResponse(builder.body)


async def _response_events(
    gw: Gateway, req: ResponsesRequest, parent: Turn | None, builder: ResponseBuilder,
    gen: Generation, book: ChoiceBook, principal: Principal,
) -> AsyncIterator[str]:  # fmt: skip
    """The typed events of a streamed response; it is stored before the last."""
    try:
        for event in builder.opening():
            yield typed_sse(event)
        async for job, out in gen.outputs():
            gen.observe(job, out)
            c = book.add(job, out)
            deltas = reply_deltas(c, out.new_text, out.finish_reason is not None)
            for event in builder.feed(deltas):
                yield typed_sse(event)
        c = book.choices[(0, 0)]
        rejected = c.tools.error if c.tools is not None else None
        closing = builder.finish(c.finish_reason, response_usage(gen.total(0)), rejected)
        if builder.body["status"] != "failed":
            _keep(gw, req, parent, builder.body, principal)
        for event in closing:
            yield typed_sse(event)
    except Exception as exc:  # an engine failure mid-stream (or the gateway's end of
        # it: its deadline, a slow client): tell the client, then end
        failure = exc.message if isinstance(exc, OpenAIError) else f"generation failed: {exc}"
        if not isinstance(exc, OpenAIError):
            logger.exception("response stream %s failed", builder.body["id"])
        for event in builder.failed(failure):
            yield typed_sse(event)


def _keep(
    gw: Gateway, req: ResponsesRequest, parent: Turn | None, body: dict[str, Any],
    owner: Principal,
) -> None:  # fmt: skip
    """Store a finished response (unless ``store: false``) with its turn: this
    request's input, then its output, after the conversation it continued; it
    belongs to ``owner``'s tenant."""
    if not req.stored:
        return
    outputs = [canonical(input_item(item, "output")) for item in body["output"]]
    turn = Turn((*req.items(), *outputs), parent, num_outputs=len(outputs))
    gw.responses.put(body["id"], body, turn, owner.tenant)


async def get_response(request: Request) -> JSONResponse:
    gw = gateway_of(request)
    response_id = _stored_id(request)
    return JSONResponse(gw.responses.body(response_id, "response_id", caller(request)))


async def delete_response(request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    response_id = _stored_id(request)
    gw.responses.delete(response_id, "response_id", caller(request))
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def input_items(request: Request) -> dict[str, Any]:
    """``GET /v1/responses/{response_id}/input_items``: the items a stored response was
    made from, newest first by default (OpenAI's list object)."""
    gw = gateway_of(request)
    limit, order, after = _item_query(request)
    response_id = str(request.path_params["response_id"])
    turn = gw.responses.turn(response_id, "response_id", caller(request))
    return item_page(turn.inputs(), limit, order, after)


def _stored_id(request: Request) -> str:
    """The id in a stored response's path (read here, not declared as a FastAPI
    parameter, so /openapi.json documents no 422); it takes no query parameters."""
    for name in request.query_params:
        raise OpenAIError(400, f"{name} is not served on stored responses (include, stream "
                          "and starting_after are not): leave it out", name)  # fmt: skip
    return str(request.path_params["response_id"])


def _item_query(request: Request) -> tuple[int, str, str | None]:
    """(limit, order, after) of an input-item listing; 400 naming a bad parameter."""
    only_params(request, _ITEM_QUERY, "input items")
    limit = int_param(request, "limit", 20, 1, 100)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise OpenAIError(400, f'order must be "asc" or "desc", got {order!r}', "order")
    return limit, order, request.query_params.get("after")
