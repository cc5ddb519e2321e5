"""Response bodies of the OpenAI-compatible API: builders, and pydantic models that
describe them in /openapi.json (the handlers build plain dicts; the models document
and, in the tests, check them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from radixserve.engine.outputs import RequestOutput

Kind = Literal["completion", "chat"]


def usage(lasts: Sequence[RequestOutput]) -> dict[str, Any]:
    """OpenAI `usage` over a request's prompts (each job's last output, completion
    tokens counted over every choice)."""
    prompt = sum(o.prompt_tokens for o in lasts)
    completion = sum(o.completion_tokens for o in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in lasts)},
    }


def envelope(kind: Kind, rid: str, created: int, model: str, stream: bool) -> dict[str, Any]:
    if kind == "completion":
        obj = "text_completion"
    else:
        obj = "chat.completion.chunk" if stream else "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": model}


def chunk(
    meta: tuple[Kind, str, int, str],
    choice: dict[str, Any],
    with_usage_field: bool,
) -> dict[str, Any]:
    """One SSE chunk carrying one choice's delta."""
    body = envelope(*meta, stream=True)
    body["choices"] = [choice]
    if with_usage_field:
        body["usage"] = None
    return body


def usage_chunk(meta: tuple[Kind, str, int, str], lasts: Sequence[RequestOutput]) -> dict:
    """The final `stream_options.include_usage` chunk: empty choices, filled usage."""
    body = envelope(*meta, stream=True)
    body.update(choices=[], usage=usage(lasts))
    return body


# -- models for /openapi.json ---------------------------------------------------------


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Doc):
    cached_tokens: int


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Doc):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class CompletionResponse(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[TokenLogprobEntry] | None
    refusal: None = None


class FunctionCallOut(_Doc):
    name: str
    arguments: str  # JSON text


class ToolCallOut(_Doc):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(_Doc):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # with a reasoning parser: the reply's reasoning


class ChatChoice(_Doc):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletionResponse(_Doc):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class InputTokensDetails(_Doc):
    cached_tokens: int


class OutputTokensDetails(_Doc):
    reasoning_tokens: int


class ResponseUsage(_Doc):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class OutputText(_Doc):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(_Doc):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(_Doc):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(_Doc):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(_Doc):
    id: str
    type: Literal["reasoning"]
    summary: list[Any]  # always empty: no summaries are written
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseObject(_Doc):
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


class ResponseItemList(_Doc):
    """`GET /v1/responses/{id}/input_items`: a page of a response's input items."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(_Doc):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class ModelIdentityCard(_Doc):
    """What computes the model's KV pages (`radixserve.model.identity.ModelIdentity`)."""

    weights: str  # "sha256:<hex>" of the checkpoint's bytes
    quantization: str  # the loaded weights' scheme, e.g. "int4 (embed int8)"
    dtype: str  # the compute dtype
    adapter: str  # "" for the base model
    short: str  # e.g. "3f2a9c0b11de/int4/bfloat16"


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str
    identity: ModelIdentityCard | None = None  # None until the workers said hello


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Doc):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Doc):
    prompt: str


class VersionResponse(_Doc):
    version: str


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(_Doc):
    error: ErrorDetail
