"""Response bodies of OpenAI's completions, chat, models and token routes: builders, and
pydantic models that describe them in /openapi.json (the handlers build plain dicts;
the models document and, in the tests, check them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from radixserve.engine.outputs import RequestOutput
from radixserve.services.gateway.server.openapi import DocModel

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
        "prompt_tokens_details": {"cached_tokens": sum(o.cached.total for o in lasts)},
    }


def envelope(kind: Kind, rid: str, created: int, model: str, stream: bool) -> dict[str, Any]:
    if kind == "completion":
        obj = "text_completion"
    else:
        obj = "chat.completion.chunk" if stream else "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": model}


def chunk(
    meta: tuple[Kind, str, int, str], choice: dict[str, Any], with_usage_field: bool
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


class PromptTokensDetails(DocModel):
    cached_tokens: int


class Usage(DocModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(DocModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(DocModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class CompletionResponse(DocModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(DocModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(DocModel):
    content: list[TokenLogprobEntry] | None
    refusal: None = None


class FunctionCallOut(DocModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(DocModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(DocModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # with a reasoning parser: the reply's reasoning


class ChatChoice(DocModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletionResponse(DocModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelIdentityCard(DocModel):
    """What computes the model's KV pages (`radixserve.model.identity.ModelIdentity`)."""

    weights: str  # "sha256:<hex>" of the checkpoint's bytes
    quantization: str  # the loaded weights' scheme, e.g. "int4 (embed int8)"
    dtype: str  # the compute dtype
    adapter: str  # "" for the base model
    short: str  # e.g. "3f2a9c0b11de/int4/bfloat16"


class ModelCard(DocModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str
    identity: ModelIdentityCard | None = None  # None until the workers said hello
    parent: str | None = None  # a LoRA adapter's: the base model's id
    fingerprint: str | None = None  # a LoRA adapter's content ("sha256:...")


class ModelList(DocModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(DocModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(DocModel):
    prompt: str


class VersionResponse(DocModel):
    version: str
