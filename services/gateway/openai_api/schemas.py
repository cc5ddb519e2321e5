"""Request bodies of the OpenAI-compatible API, as pydantic models.

The models validate strictly (a JSON ``true`` is not an integer, ``"1"`` is not a
number), carry OpenAI's value ranges (so /openapi.json describes the real bodies) and
forbid unknown fields: a field the API does not define, or defines but radixserve does
not implement, is refused with a 400 naming it, never silently ignored. The only fields
accepted and ignored are those that do not change the output (`user`, `metadata`,
`safety_identifier`, `service_tier` "auto"/"default", `store` false); `cache_salt`
(vLLM's) and `prompt_cache_key` (OpenAI's) change only which cached KV a request may
share and where it is routed (`CacheSalt`, `PromptCacheKey`); `priority` (vLLM's) only
when it is computed (`Priority`). Cross-field and
engine-level checks raise `OpenAIError` or are left to `SamplingParams`, which raises
`InvalidRequestError` (HTTP 400) naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema

from radixserve.engine.sampling_params import MAX_CHOICES, MAX_LOGPROBS, SEED_MAX, SEED_MIN
from radixserve.services.gateway.openai_api.fields import (
    TOKEN_COUNT,
    TOKEN_ID,
    Body,
    CacheSalt,
    Int,
    Priority,
    PromptCacheKey,
    RequestTimeout,
    Text,
)
from radixserve.services.gateway.server.errors import OpenAIError

Prompt = Annotated[
    Text
    | Annotated[list[TOKEN_ID], Field(min_length=1)]
    | Annotated[list[Text], Field(min_length=1, max_length=256)]
    | Annotated[list[Annotated[list[TOKEN_ID], Field(min_length=1)]], Field(min_length=1,
                                                                             max_length=256)],
    Field(description="One prompt (text or token ids) or a list of them (up to 256)."),
]  # fmt: skip


class StreamOptions(Body):
    include_usage: bool | None = Field(False, description="Send a last chunk with usage.")


class JsonSchemaFormat(Body):
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _format_guide(fmt: ResponseFormat) -> tuple[str, str]:
    if fmt.type == "json_object":
        return "json_object", ""
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise OpenAIError(
            400, "response_format json_schema needs json_schema.schema", "response_format"
        )
    return "json_schema", json.dumps(fmt.json_schema.schema_)


class GenerationRequest(Body):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, max_length=256, description="A served name or 'default'.")
    max_tokens: TOKEN_COUNT | None = Field(
        None, description="Most tokens to generate; more than the context leaves is a 400."
    )
    min_tokens: TOKEN_COUNT | None = Field(None, description="EOS is suppressed until this many.")
    ignore_eos: bool | None = None
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1, le=2**31 - 1, description="0 or -1: off.")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Text | Annotated[list[Text], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TOKEN_ID], Field(max_length=1024)] | None = None
    n: Int | None = Field(None, ge=1, le=MAX_CHOICES, description="Choices per prompt.")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10, description="vLLM's; 1 = off.")
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=1024)] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit."
    )  # fmt: skip
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM: a JSON schema.")
    guided_regex: str | None = Field(
        None, description="vLLM: a regex (at most the gateway's max_guided_regex_chars)."
    )
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = Field(
        None, description="vLLM: the reply is one of these (at most the gateway's "
        "max_guided_choices, each of max_guided_choice_chars).",
    )  # fmt: skip
    guided_grammar: str | None = Field(
        None, description="A Lark grammar (at most the gateway's max_guided_grammar_chars)."
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="Ignored (as by OpenAI).")
    service_tier: Literal["auto", "default"] | None = Field(None, description="Ignored.")
    cache_salt: CacheSalt = None
    prompt_cache_key: PromptCacheKey = None
    priority: Priority = None
    timeout: RequestTimeout = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def guided(self) -> tuple[str, str, str]:
        """(field, guide_kind, guide): `guide` and the request field it comes from
        (("", "", "") without one)."""
        fmt = self.response_format
        candidates: list[tuple[str, tuple[str, str] | None]] = [
            ("response_format", _format_guide(fmt) if fmt and fmt.type != "text" else None),
            ("guided_json", None if self.guided_json is None else (
                "json_schema", self.guided_json if isinstance(self.guided_json, str)
                else json.dumps(self.guided_json))),
            ("guided_regex", None if self.guided_regex is None else ("regex", self.guided_regex)),
            ("guided_choice", None if self.guided_choice is None else (
                "choice", json.dumps(self.guided_choice))),
            ("guided_grammar", None if self.guided_grammar is None else (
                "lark", self.guided_grammar)),
        ]  # fmt: skip
        given = [(name, guide) for name, guide in candidates if guide is not None]
        if len(given) > 1:
            first, second = given[0][0], given[1][0]
            raise OpenAIError(400, f"{second} cannot be combined with {first}: only one "
                              "structured-output constraint is allowed", second)  # fmt: skip
        return (given[0][0], *given[0][1]) if given else ("", "", "")

    def bias(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 10:
                raise OpenAIError(400, f"logit_bias keys must be token ids, got {key!r}",
                                  "logit_bias")  # fmt: skip
            out[int(key)] = value
        return out


class CompletionRequest(GenerationRequest):
    """`POST /v1/completions`. max_tokens defaults to 16 (as OpenAI's)."""

    prompt: Prompt
    best_of: Int | None = Field(None, ge=1, le=MAX_CHOICES)
    echo: bool | None = Field(False, description="Prepend the prompt (and its logprobs).")
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top alternatives.")
    suffix: str | None = Field(None, max_length=0, description="Not supported: must be empty.")

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the request (text or token ids), in order."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(max_length=1 << 20, description="The arguments as JSON text.")


class ToolCall(Body):
    """A call an earlier assistant message made (conversation history)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCall

    def to_template(self) -> dict[str, Any]:
        """As templates read it: arguments holding a JSON object become that object
        (Qwen's and Hermes' templates write ``arguments | tojson``), as vLLM passes them."""
        try:
            args: Any = json.loads(self.function.arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            args = self.function.arguments
        function = {"name": self.function.name, "arguments": args}
        return {"id": self.id, "type": "function", "function": function}


def _only_with_role(role: str, field: str) -> dict[str, Any]:
    """``field`` is given with ``role`` messages and only there (`to_template` checks it)."""
    return {"if": {"properties": {"role": {"const": role}}}, "then": {"required": [field]},
            "else": {"not": {"required": [field]}}}  # fmt: skip


def _content_documented_required(schema: dict[str, Any]) -> None:
    # documented as OpenAI's: present (null for an assistant message with tool_calls);
    # an assistant message leaving it out is accepted too
    schema["required"] = [*schema.get("required", []), "content"]
    calls_only_for_assistants = {"if": {"properties": {"role": {"const": "assistant"}}},
                                 "else": {"not": {"required": ["tool_calls"]}}}  # fmt: skip
    schema["allOf"] = [_only_with_role("tool", "tool_call_id"), calls_only_for_assistants]


class ChatMessage(Body):
    model_config = ConfigDict(**Body.model_config, json_schema_extra=_content_documented_required)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=256)] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = Field(
        None, description="An assistant message's calls (its content may then be null)."
    )
    tool_call_id: str | None = Field(
        None, max_length=256, description="A tool message: the call it answers."
    )
    reasoning_content: str | None = Field(
        None, description="An assistant message's reasoning (as replies return it): given "
        "to the chat template, which keeps or drops it as the model was trained.",
    )  # fmt: skip

    def to_template(self, index: int = 0) -> dict[str, Any]:
        """The message as the chat template sees it (text parts joined, tool calls with
        their arguments as objects); raises `OpenAIError` for a message missing what its
        role needs."""
        where = f"messages[{index}]"
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        if "content" not in self.model_fields_set and not (
            self.role == "assistant" and self.tool_calls
        ):
            raise OpenAIError(400, f"{where}.content is missing: only an assistant message "
                              "with tool_calls may leave it out", f"{where}.content")  # fmt: skip
        if self.tool_calls is not None and self.role != "assistant":
            raise OpenAIError(400, f"{where}.tool_calls is only for assistant messages",
                              f"{where}.tool_calls")  # fmt: skip
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise OpenAIError(400, f"{where}.tool_call_id is required for a tool message and "
                              "only allowed there", f"{where}.tool_call_id")  # fmt: skip
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.to_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            if self.role != "assistant":
                raise OpenAIError(400, f"{where}.reasoning_content is only for assistant "
                                  "messages", f"{where}.reasoning_content")  # fmt: skip
            out["reasoning_content"] = self.reasoning_content
        return out


_FUNCTION_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
#: the documented shapes of `tools` and `tool_choice`; `tool_request` checks them
#: itself, so that a mistake is refused with a sentence naming the field
TOOLS_SCHEMA = {
    "type": "array",
    "maxItems": 128,
    "items": {
        "type": "object",
        "required": ["type", "function"],
        "additionalProperties": False,
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": _FUNCTION_NAME,
                    "description": {"type": "string"},
                    "parameters": {"type": "object"},
                    "strict": {"type": "boolean"},
                },
            },
        },
    },
}
TOOL_CHOICE_SCHEMA = {"anyOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {"type": {"const": "function"}, "function": {
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": _FUNCTION_NAME}}}}]}  # fmt: skip

#: template variables a request may not set: the ones the server passes itself
_RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token")


class TemplateKwargs(Body):
    """``chat_template_kwargs``: extra variables for the model's chat template (e.g.
    Qwen3's ``enable_thinking``), as transformers' `apply_chat_template` takes them."""

    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=16)] | None = Field(
        None, description='Extra variables of the chat template, e.g. {"enable_thinking": false}.'
    )

    def template_kwargs(self) -> dict[str, Any]:
        given = self.chat_template_kwargs or {}
        for name in given:
            if not name.isidentifier() or name in _RESERVED_TEMPLATE_VARIABLES:
                raise OpenAIError(400, f"chat_template_kwargs: {name!r} cannot be set (the "
                                  "server sets it, or it is not a template variable name)",
                                  "chat_template_kwargs")  # fmt: skip
        return dict(given)


class ChatCompletionRequest(GenerationRequest, TemplateKwargs):
    """`POST /v1/chat/completions`. max_completion_tokens wins over max_tokens."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: TOKEN_COUNT | None = None
    logprobs: bool | None = Field(False, description="Return the tokens' log-probabilities.")
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[dict[str, Any]], WithJsonSchema(TOOLS_SCHEMA)] | None = Field(
        None,
        description='Functions the model may call: {"type": "function", "function": '
        '{"name", "description", "parameters" (a JSON schema)}}.',
    )
    tool_choice: Annotated[str | dict[str, Any], WithJsonSchema(TOOL_CHOICE_SCHEMA)] | None = Field(
        None,
        description='"none", "auto" (the default with tools), "required", or '
        '{"type": "function", "function": {"name": ...}}.',
    )
    parallel_tool_calls: bool | None = Field(
        None, description="Whether a reply may hold several calls (false: at most one)."
    )
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = Field(
        None, description="Ignored."
    )
    store: Literal[False] | None = Field(None, description="Completions are never stored.")
    safety_identifier: str | None = Field(None, max_length=256, description="Ignored.")
    modalities: list[Literal["text"]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="Set through the chat template's thinking switch (none and minimal: "
        "off; the others: on); a model whose template has none accepts only medium.",
    )  # fmt: skip
    thinking_token_budget: Int | None = Field(
        None, ge=0, le=2**31 - 1,
        description="vLLM's: most tokens the reply may reason; then the reasoning format's "
        "end marker (</think>) is written and the model answers. A thinking model only.",
    )  # fmt: skip

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def num_top_logprobs(self) -> int | None:
        """How many alternatives per token (None: no logprobs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template(i) for i, m in enumerate(self.messages)]


class TokenizeRequest(TemplateKwargs):
    """`POST /tokenize` (vLLM's shape): a prompt, or messages through the chat template."""

    model: str | None = Field(None, max_length=256)
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False
    tools: list[dict[str, Any]] | None = Field(
        None, description="With messages: function tools, rendered as chat completions "
        "render them (the prompt a chat request with these tools runs).",
    )  # fmt: skip

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template(i) for i, m in enumerate(self.messages or ())]


class DetokenizeRequest(Body):
    """`POST /detokenize` (vLLM's shape)."""

    model: str | None = Field(None, max_length=256)
    tokens: Annotated[list[TOKEN_ID], Field(max_length=1 << 20)]
