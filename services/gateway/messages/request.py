"""The request side of Anthropic's Messages API (``POST /v1/messages`` and ``POST
/v1/messages/count_tokens``): the bodies and the fields refused by name. The chat
conversation a request runs as, and its plan, are `plan`'s.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field

from radixserve.engine.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SEED_MAX,
    SEED_MIN,
)
from radixserve.services.gateway.openai_api.fields import TOKEN_COUNT, Body, Int
from radixserve.services.gateway.server.errors import OpenAIError, validated

MAX_MESSAGES = 4096  # as chat's messages
MAX_BLOCKS = 1024  # content blocks per message
_NAME = r"^[A-Za-z0-9_-]{1,64}$"
_ID = Annotated[str, Field(min_length=1, max_length=256)]

#: Anthropic fields radixserve does not serve -> why, and what to send instead
REFUSED: dict[str, str] = {
    "container": "is not served (no code execution containers); leave it out",
    "mcp_servers": "is not served (radixserve connects to no MCP servers); leave it out",
    "context_management": "is not served: send the context you want the model to see",
    "output_format": "is not served on /v1/messages: force a tool with tool_choice, or use "
    "/v1/chat/completions with response_format",
    "output_config": "is not served; leave it out",
    "inference_geo": "is not served; leave it out",
}
#: content block types radixserve does not take -> why
_REFUSED_BLOCKS = {
    "image": "is not served (text models only)",
    "document": "is not served (text models only): send the text as a text block",
    "search_result": "is not served: send the text as a text block",
    "server_tool_use": "is not served (radixserve runs no server tools)",
    "web_search_tool_result": "is not served (radixserve runs no server tools)",
    "container_upload": "is not served (no code execution containers)",
}


class CacheControl(Body):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = Field(None, description="Accepted; caching is automatic.")


_CACHE = Field(None, description="Accepted: the prefix cache is automatic.")


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = _CACHE


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: _ID
    name: str = Field(pattern=_NAME)
    input: dict[str, Any] = Field(description="The call's arguments.")
    cache_control: CacheControl | None = _CACHE


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: _ID = Field(description="The tool_use this answers.")
    content: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    is_error: bool | None = Field(None, description='The content is prefixed "Error: ".')
    cache_control: CacheControl | None = _CACHE


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = _CACHE


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: str
    cache_control: CacheControl | None = _CACHE


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
_BLOCKS: dict[str, type[Block]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock,
}
_ROLE_BLOCKS = {"user": ("text", "tool_result"),
                "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}  # fmt: skip


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1, max_length=MAX_BLOCKS)]


class Tool(Body):
    type: Literal["custom"] | None = Field(
        None, description='Only custom tools ("custom" or left out): no server tools.'
    )
    name: str = Field(pattern=_NAME)
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="The input's JSON schema.")
    strict: bool | None = Field(
        None, description="Enforced where the call is forced (tool_choice any or tool)."
    )
    eager_input_streaming: bool | None = Field(
        None, description="Accepted: a call's input always streams as it is generated."
    )
    cache_control: CacheControl | None = _CACHE


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, pattern=_NAME, description='With "tool": the tool.')
    disable_parallel_tool_use: bool | None = Field(None, description="At most one call.")


class Thinking(Body):
    type: Literal["enabled", "disabled", "adaptive"] = Field(
        description="The chat template's thinking switch on or off; adaptive: the model's "
        "own behaviour."
    )
    budget_tokens: Int | None = Field(
        None, ge=1024, le=2**31 - 1,
        description='Most tokens the reply may think (with "enabled", required).',
    )  # fmt: skip
    display: Literal["summarized", "omitted"] | None = Field(
        None, description="summarized (default): the whole reasoning; omitted: empty "
        "thinking blocks.",
    )  # fmt: skip


class Metadata(Body):
    user_id: str | None = Field(
        None, max_length=256, description="Accepted (as chat's user: it changes no output)."
    )


_Prompt = TypeVar("_Prompt", bound="MessagesPrompt")  # typing.Self is Python 3.11+


class MessagesPrompt(Body):
    """What makes the prompt: the fields of ``count_tokens``."""

    model: str = Field(min_length=1, max_length=256, description="A served name or 'default'.")
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = _CACHE

    @classmethod
    def checked(cls: type[_Prompt], body: dict[str, Any]) -> _Prompt:
        """The request in `body`: unserved fields refused by name, each message's blocks
        checked under their own names, then the rest."""
        for name, why in REFUSED.items():
            if name in body:
                raise OpenAIError(400, f"{name} {why}", name)
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) <= MAX_MESSAGES:
            body = {**body, "messages": [_message(raw, i) for i, raw in enumerate(messages)]}
        return validated(cls, body)


class CountTokensRequest(MessagesPrompt):
    """``POST /v1/messages/count_tokens``."""


class MessagesRequest(MessagesPrompt):
    """``POST /v1/messages``. Build with `checked`."""

    max_tokens: TOKEN_COUNT = Field(ge=1, description="Most tokens to generate.")
    stop_sequences: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]],
        Field(max_length=MAX_STOP_STRINGS),
    ] | None = None  # fmt: skip
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=0, le=2**31 - 1, description="0: off.")
    seed: Int | None = Field(
        None, ge=SEED_MIN, le=SEED_MAX,
        description="radixserve's extension, as chat's seed: a sampled reply reproducible "
        "wherever it runs.",
    )  # fmt: skip
    metadata: Metadata | None = None
    stream: bool | None = False
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="Ignored.")


def _block(raw: Any, where: str, role: Any) -> Block:
    """One content block, checked; errors name `where`."""
    if not isinstance(raw, dict):
        raise OpenAIError(400, f"{where} must be an object (a content block)", where)
    given = raw.get("type")
    kind = given if isinstance(given, str) else ""  # (only a string is a block type)
    allowed = _ROLE_BLOCKS.get(role if isinstance(role, str) else "", tuple(_BLOCKS))
    if kind not in allowed:
        why = _REFUSED_BLOCKS.get(kind, "is not a content block type")
        if kind in _BLOCKS:
            why = f"is not a block of a {role} message"
        raise OpenAIError(400, f"{where}.type {json.dumps(given)[:80]} {why} (accepted "
                          f"here: {', '.join(allowed)})", f"{where}.type")  # fmt: skip
    return validated(_BLOCKS[kind], raw, where)


def _message(raw: Any, i: int) -> Any:  # the raw message, its blocks checked
    """A message with its content blocks checked (the rest is checked by the model)."""
    content = raw.get("content") if isinstance(raw, dict) else None
    if not isinstance(content, list) or len(content) > MAX_BLOCKS:
        return raw
    where = f"messages[{i}].content"
    blocks = [_block(b, f"{where}[{j}]", raw.get("role")) for j, b in enumerate(content)]
    return {**raw, "content": blocks}
