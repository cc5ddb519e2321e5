"""The response side of the Responses API: a response object's output items, built from
the chat path's message deltas (``{"content": ...}``, ``{"tool_calls": [...]}`` as
`choices.reply_deltas` lets them out), and the typed events that stream them.

Events, each with the next ``sequence_number`` (OpenAI's order, which the SDK's stream
helpers check)::

    response.created, response.in_progress
    per reasoning:   response.output_item.added (reasoning), response.content_part.added,
                     response.reasoning_text.delta ..., response.reasoning_text.done,
                     response.content_part.done, response.output_item.done
    per text reply:  response.output_item.added (message), response.content_part.added,
                     response.output_text.delta ..., response.output_text.done,
                     response.content_part.done, response.output_item.done
    per call:        response.output_item.added (function_call),
                     response.function_call_arguments.delta, ...arguments.done,
                     response.output_item.done
    response.completed (status completed), or response.incomplete (max_output_tokens),
    or error and response.failed (a streamed call the parser then rejected)

The non-streamed response is built by the same `ResponseBuilder` (its events
dropped), so a streamed response reassembles to exactly the non-streamed one. The
pydantic models at the end describe its bodies in /openapi.json (and the tests check
them).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from radixserve.engine.outputs import RequestOutput
from radixserve.services.gateway.server.openapi import DocModel
from radixserve.services.gateway.tools.tool_stream import is_json_object


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(last: RequestOutput) -> dict[str, Any]:
    """The Responses API's usage of one generation (prompt tokens served from the prefix
    cache in ``input_tokens_details.cached_tokens``)."""
    return {
        "input_tokens": last.prompt_tokens,
        "input_tokens_details": {"cached_tokens": last.cached.total},
        "output_tokens": last.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": last.prompt_tokens + last.completion_tokens,
    }


#: the output items that hold text -> their content part's type, which names their events
_TEXT_TYPES = {"message": "output_text", "reasoning": "reasoning_text"}


def _text_item(kind: str) -> dict[str, Any]:
    """A new output item of `kind` that holds text: ``message`` or ``reasoning``."""
    if kind == "message":
        return {"id": new_id("msg"), "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}  # fmt: skip
    return {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
            "status": "in_progress"}  # fmt: skip


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _logprobs(kind: str) -> dict[str, Any]:
    """The extra field of a message's text events (a reasoning item's have none)."""
    return {"logprobs": []} if kind == "message" else {}


class ResponseBuilder:
    """One response object (``body``: the skeleton, then its output as it comes) and
    the events that stream it."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.seq = 0
        self._item: dict[str, Any] | None = None  # the open output item
        self._text: list[str] = []  # the open message's (or reasoning's) text

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _where(self) -> dict[str, Any]:
        assert self._item is not None
        return {"item_id": self._item["id"], "output_index": len(self.body["output"]) - 1}

    def opening(self) -> list[dict[str, Any]]:
        snapshot = copy.deepcopy(self.body)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]  # fmt: skip

    def feed(self, deltas: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events for a choice's new message deltas."""
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._add("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._add("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                if "id" in call:  # a call's opening delta: its id and name
                    events += self._close("completed")
                    events += self._open({"id": new_id("fc"), "type": "function_call",
                                          "call_id": call["id"], "name": call["function"]["name"],
                                          "arguments": "", "status": "in_progress"})  # fmt: skip
                else:
                    assert self._item is not None and self._item["type"] == "function_call"
                    arguments = call["function"]["arguments"]
                    self._item["arguments"] += arguments
                    events.append(self._event("response.function_call_arguments.delta",
                                              **self._where(), delta=arguments))  # fmt: skip
        return events

    def finish(
        self, reason: str | None, usage: dict[str, Any], rejected: str | None = None
    ) -> list[dict[str, Any]]:
        """The closing events once the choice finished with `reason`; the body then is
        the final response. A reply with no output gets an empty message, so every turn
        of a conversation has its assistant item. `rejected`: why the streamed calls
        were rejected after one had opened (`ToolCallStream.error`): the open call ends
        ``incomplete``, the response ``incomplete`` (cut by max_output_tokens) or
        ``failed`` (error code ``server_error``, the reason in its message)."""
        status = "completed" if reason in ("stop", "tool_calls") else "incomplete"
        if rejected is not None and status == "completed":
            status = "failed"
        events = [] if self.body["output"] else self._add("message", "")
        events += self._close(status, call_done=rejected is None)
        self.body.update(status=status, usage=usage)
        if status == "incomplete":
            cause = "max_output_tokens" if reason == "length" else None
            self.body["incomplete_details"] = {"reason": cause}
        if status == "failed":
            message = f"the reply's tool calls were rejected: {rejected}"
            self.body["error"] = {"code": "server_error", "message": message}
            events.append(self._event("error", code="server_error", message=message, param=None))
        events.append(self._event(f"response.{status}", response=copy.deepcopy(self.body)))
        return events

    def failed(self, message: str) -> list[dict[str, Any]]:
        """The events that end a stream whose generation failed."""
        error = {"code": "server_error", "message": message}
        self.body.update(status="failed", error=error)
        return [self._event("error", code="server_error", message=message, param=None),
                self._event("response.failed", response=copy.deepcopy(self.body))]  # fmt: skip

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._item = item
        self.body["output"].append(item)
        return [self._event("response.output_item.added", output_index=len(self.body["output"])
                            - 1, item=copy.deepcopy(item))]  # fmt: skip

    def _add(self, kind: str, text: str) -> list[dict[str, Any]]:
        """The events adding `text` to the open `kind` item (``message`` or
        ``reasoning``), opened first if another is open."""
        events = []
        if self._item is None or self._item["type"] != kind:
            events += self._close("completed")
            events += self._open(_text_item(kind))
            events.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0, part=_part(kind, "")))  # fmt: skip
        if text:
            self._text.append(text)
            events.append(self._event(f"response.{_TEXT_TYPES[kind]}.delta", **self._where(),
                                      content_index=0, delta=text, **_logprobs(kind)))  # fmt: skip
        return events

    def _close(self, status: str, call_done: bool = True) -> list[dict[str, Any]]:
        """The events that finish the open item, if any: `status` for a message; a
        function call is ``completed`` when `call_done` and its arguments are a JSON
        object, else ``incomplete``."""
        item, where = self._item, self._where() if self._item else {}
        if item is None:
            return []
        self._item = None
        events = []
        if item["type"] in _TEXT_TYPES:
            kind, text, self._text = item["type"], "".join(self._text), []
            part = _part(kind, text)
            item["content"] = [part]
            events.append(self._event(f"response.{_TEXT_TYPES[kind]}.done", **where,
                                      content_index=0, text=text, **_logprobs(kind)))  # fmt: skip
            events.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=copy.deepcopy(part)))  # fmt: skip
        else:
            done = call_done and is_json_object(item["arguments"])
            status = "completed" if done else "incomplete"
            events.append(self._event("response.function_call_arguments.done", **where,
                                      name=item["name"], arguments=item["arguments"]))  # fmt: skip
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=where["output_index"],
                                  item=copy.deepcopy(item)))  # fmt: skip
        return events


# -- models for /openapi.json ---------------------------------------------------------


class InputTokensDetails(DocModel):
    cached_tokens: int


class OutputTokensDetails(DocModel):
    reasoning_tokens: int


class ResponseUsage(DocModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class OutputText(DocModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(DocModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(DocModel):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(DocModel):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(DocModel):
    id: str
    type: Literal["reasoning"]
    summary: list[Any]  # always empty: no summaries are written
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseObject(DocModel):
    """A Responses API response (`POST /v1/responses`, `GET /v1/responses/{id}`)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    model: str
    output: list[OutputReasoning | OutputMessage | OutputFunctionCall]
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float
    top_p: float
    text: dict[str, Any]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    metadata: dict[str, str]
    user: str | None
    reasoning: dict[str, Any]  # {"effort": as requested or null, "summary": null}


class ResponseItemList(DocModel):
    """`GET /v1/responses/{id}/input_items`: a page of a response's input items."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(DocModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool
