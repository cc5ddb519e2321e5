"""The request side of Anthropic's Messages API (``POST /v1/messages`` and ``POST
/v1/messages/count_tokens``): the bodies, the fields refused by name, and the chat
conversation a request runs as.

A request runs through the chat path's pieces, as the Responses API's does. ``system``
becomes a system message first; a user turn's ``text`` blocks its content and its
``tool_result`` blocks ``tool`` messages (``is_error`` results prefixed ``Error: ``); an
assistant turn's ``tool_use`` blocks its ``tool_calls`` (``input`` as the arguments
object), its ``thinking`` blocks its ``reasoning_content`` (which the template keeps or
drops, as it does an earlier turn's reasoning). Tools (``name``, ``description``, ``input_schema``) go
through `tool_request.check_tools` and the model's rendering; ``tool_choice`` ``any`` and
``{"type": "tool"}`` become the grammar of a forced call. ``cache_control`` is accepted
anywhere Anthropic takes it: the prefix cache is automatic.

``thinking`` sets the chat template's thinking switch where it has one
(`reasoning.ReasoningFormat`: ``enabled`` on, ``disabled`` off); a thinking model
without a switch takes only ``enabled``, a model that does not think only
``disabled``; ``adaptive`` leaves the model to its own behaviour. Anything else is
refused naming ``thinking``. ``budget_tokens`` (required with ``enabled`` and only
there, at least 1024) caps the reply's reasoning: once it has thought that many tokens
the engine writes the format's end marker (``</think>``) and the model answers
(`SamplingParams.thinking_token_budget`); thinking counts toward ``max_tokens`` as
well, so a budget of ``max_tokens`` or more cannot bind (accepted, as it is harmless).
A forced tool (``tool_choice`` ``any`` or ``tool``) is held to its grammar from the
first token, so it is refused with ``enabled`` thinking, as Anthropic refuses it.
``display``: ``summarized`` (the default) returns the whole reasoning as the
thinking block's text (the "summary" here is the reasoning itself); ``omitted``
returns thinking blocks with an empty ``thinking`` (streamed: no ``thinking_delta``).

`count_tokens` and a generation build the prompt with the same function
(`conversation`), so the count is the prompt a request with that body is charged.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Annotated, Any, Literal, Self

from pydantic import Field, ValidationError

from radixserve.engine.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SEED_MAX,
    SEED_MIN,
)
from radixserve.runtime.engine_client import EngineClient
from radixserve.services.gateway.openai_api.limits import PrepareLimits
from radixserve.services.gateway.openai_api.plan import (
    Conversation,
    Plan,
    conversation_job,
    job_guide,
    reasoning_of,
    with_thinking_budget,
)
from radixserve.services.gateway.openai_api.preparer import Preparation
from radixserve.services.gateway.openai_api.schemas import (
    TOKEN_COUNT,
    FunctionCall,
    GenerationRequest,
    Int,
    ToolCall,
    _Body,
)
from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.services.gateway.server.field_errors import describe
from radixserve.services.gateway.tools.reasoning import DEFAULT_EFFORT, ReasoningFormat
from radixserve.services.gateway.tools.tool_request import (
    RESPONSES_TOOLS,
    ToolFormat,
    ToolRequest,
    check_tools,
    with_tools,
)

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


class CacheControl(_Body):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = Field(None, description="Accepted; caching is automatic.")


_CACHE = Field(None, description="Accepted: the prefix cache is automatic.")


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = _CACHE


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: _ID
    name: str = Field(pattern=_NAME)
    input: dict[str, Any] = Field(description="The call's arguments.")
    cache_control: CacheControl | None = _CACHE


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: _ID = Field(description="The tool_use this answers.")
    content: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    is_error: bool | None = Field(None, description='The content is prefixed "Error: ".')
    cache_control: CacheControl | None = _CACHE


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = _CACHE


class RedactedThinkingBlock(_Body):
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


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1, max_length=MAX_BLOCKS)]


class Tool(_Body):
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


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, pattern=_NAME, description='With "tool": the tool.')
    disable_parallel_tool_use: bool | None = Field(None, description="At most one call.")


class Thinking(_Body):
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


class Metadata(_Body):
    user_id: str | None = Field(
        None, max_length=256, description="Accepted (as chat's user: it changes no output)."
    )


class MessagesPrompt(_Body):
    """What makes the prompt: the fields of ``count_tokens``."""

    model: str = Field(min_length=1, max_length=256, description="A served name or 'default'.")
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = _CACHE

    @classmethod
    def checked(cls, body: dict[str, Any]) -> Self:
        """The request in `body`: unserved fields refused by name, each message's blocks
        checked under their own names, then the rest."""
        for name, why in REFUSED.items():
            if name in body:
                raise OpenAIError(400, f"{name} {why}", name)
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) <= MAX_MESSAGES:
            body = {**body, "messages": [_message(raw, i) for i, raw in enumerate(messages)]}
        try:
            req = cls.model_validate(body)
        except ValidationError as exc:
            message, param = describe(exc.errors())
            raise OpenAIError(400, message, param) from None
        return req


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
    try:
        return _BLOCKS[kind].model_validate(raw)
    except ValidationError as exc:
        message, param = describe(exc.errors(), where)
        raise OpenAIError(400, message, param) from None


def _message(raw: Any, i: int) -> Any:  # the raw message, its blocks checked
    """A message with its content blocks checked (the rest is checked by the model)."""
    content = raw.get("content") if isinstance(raw, dict) else None
    if not isinstance(content, list) or len(content) > MAX_BLOCKS:
        return raw
    where = f"messages[{i}].content"
    blocks = [_block(b, f"{where}[{j}]", raw.get("role")) for j, b in enumerate(content)]
    return {**raw, "content": blocks}


def _text(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "".join(b.text for b in blocks)


def template_messages(req: MessagesPrompt) -> list[dict[str, Any]]:
    """The conversation as chat template messages (see the module docstring); raises
    `OpenAIError` for a result that answers no call, or a final assistant turn."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    calls: set[str] = set()
    for i, message in enumerate(req.messages):
        blocks: list[Any] = message.content if isinstance(message.content, list) else [
            TextBlock(type="text", text=message.content)]  # fmt: skip
        if message.role == "assistant":
            out.append(_assistant(blocks, calls))
            continue
        text: list[str] = []
        for j, block in enumerate(blocks):
            if isinstance(block, TextBlock):
                text.append(block.text)
                continue
            if block.tool_use_id not in calls:
                where = f"messages[{i}].content[{j}].tool_use_id"
                raise OpenAIError(400, f"{where} {block.tool_use_id!r} answers no tool_use of "
                                  "an earlier assistant message", where)  # fmt: skip
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = _text(block.content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {result}" if block.is_error else result})  # fmt: skip
        if text or not blocks:
            out.append({"role": "user", "content": "".join(text)})
    last = len(req.messages) - 1
    if req.messages[last].role == "assistant":
        raise OpenAIError(400, f"messages[{last}].role: a final assistant message (a reply "
                          "to continue) is not served: end with a user message",
                          f"messages[{last}].role")  # fmt: skip
    return out


def _assistant(blocks: list[Any], calls: set[str]) -> dict[str, Any]:
    """An assistant turn: its text, its thinking as reasoning_content, its tool_use
    blocks as tool_calls (redacted thinking dropped: there is no text to give)."""
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    message: dict[str, Any] = {"role": "assistant", "content": text}
    thought = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    if thought:
        message["reasoning_content"] = thought
    uses = [b for b in blocks if isinstance(b, ToolUseBlock)]
    if uses:
        calls.update(b.id for b in uses)
        message["tool_calls"] = [
            ToolCall(id=b.id, type="function", function=FunctionCall(
                name=b.name, arguments=json.dumps(b.input, ensure_ascii=False))).to_template()
            for b in uses
        ]  # fmt: skip
    return message


def _renamed(exc: OpenAIError) -> OpenAIError:
    """An error of the chat tools' checks, naming the fields as this API spells them."""
    param = exc.param.replace(".parameters", ".input_schema") if exc.param else exc.param
    message = exc.message.replace(".parameters", ".input_schema")
    if param == "tool_choice" and "names the function" in message:
        param = "tool_choice.name"
        message = message.replace("tool_choice names the function", f"{param} names the tool")
    return OpenAIError(exc.status, message, param, exc.headers)


def checked_tools(req: MessagesPrompt, limits: PrepareLimits) -> ToolRequest | None:
    """The checked tools (None: none, or tool_choice none), in the chat path's terms."""
    flat = [{"type": "function", "name": t.name, "parameters": t.input_schema,
             **({"description": t.description} if t.description is not None else {}),
             **({"strict": t.strict} if t.strict is not None else {})}
            for t in req.tools or ()]  # fmt: skip
    choice: Any = None
    parallel = None
    if req.tool_choice is not None:
        c = req.tool_choice
        if c.type == "tool" and c.name is None:
            raise OpenAIError(400, 'tool_choice.name is required with type "tool"',
                              "tool_choice.name")  # fmt: skip
        if c.type != "tool" and c.name is not None:
            raise OpenAIError(400, 'tool_choice.name is only for type "tool"', "tool_choice.name")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) or {
            "type": "function", "name": c.name}  # fmt: skip
        parallel = None if c.disable_parallel_tool_use is None else not c.disable_parallel_tool_use
    try:
        return check_tools(flat, choice, parallel, False, RESPONSES_TOOLS, limits)
    except OpenAIError as exc:
        raise _renamed(exc) from None


def thinking_variables(fmt: ReasoningFormat | None, thinking: Thinking | None) -> dict[str, Any]:
    """The template variables of ``thinking`` (see the module docstring); a setting
    this model cannot follow is refused naming ``thinking``."""
    if thinking is None or (thinking.type == "adaptive" and thinking.budget_tokens is None):
        return {}
    on = thinking.type == "enabled"
    if on and thinking.budget_tokens is None:
        raise OpenAIError(400, 'thinking.budget_tokens is required with type "enabled"',
                          "thinking.budget_tokens")  # fmt: skip
    if not on and thinking.budget_tokens is not None:
        raise OpenAIError(400, 'thinking.budget_tokens is only for type "enabled"',
                          "thinking.budget_tokens")  # fmt: skip
    kind = thinking.type
    if fmt is None or fmt.parser == "none":
        if on:
            raise OpenAIError(400, f'thinking {{"type": "{kind}"}} is not served: this model '
                              "does not think (its chat template has no reasoning format); "
                              'send {"type": "disabled"} or leave it out', "thinking")  # fmt: skip
        return {}
    if fmt.switch is None:
        if not on:
            raise OpenAIError(400, f'thinking {{"type": "{kind}"}} is not served: this model '
                              "always thinks (its chat template has no thinking switch); "
                              'send {"type": "enabled"} or leave it out', "thinking")  # fmt: skip
        return {}
    return fmt.effort_variables(DEFAULT_EFFORT if on else "none", "thinking")


async def conversation(
    req: MessagesPrompt, tool_format: ToolFormat, reasoning: ReasoningFormat | None,
    limits: PrepareLimits, prep: Preparation,
) -> tuple[list[dict[str, Any]], dict[str, Any], ToolRequest | None]:  # fmt: skip
    """(template messages, template variables, checked tools) of a request's prompt."""
    tools = checked_tools(req, limits)
    switch = thinking_variables(reasoning, req.thinking)
    messages = await prep.run("messages", template_messages, req)
    messages, kwargs = await prep.run("messages", with_tools, messages, switch, tools,
                                      tool_format)  # fmt: skip
    return messages, kwargs, tools


async def count_prompt(
    req: CountTokensRequest, client: EngineClient, tool_format: ToolFormat,
    reasoning: ReasoningFormat | None, limits: PrepareLimits, prep: Preparation,
) -> int:  # fmt: skip
    """The prompt tokens of a request with this body (as `messages_plan` renders it)."""
    messages, kwargs, _ = await conversation(req, tool_format, reasoning, limits, prep)
    ids = await prep.run("messages", partial(client.tokenizer.encode_chat, messages, **kwargs))
    return len(ids)


async def messages_plan(
    req: MessagesRequest, client: EngineClient, tool_format: ToolFormat,
    reasoning: ReasoningFormat | None, limits: PrepareLimits, prep: Preparation,
) -> Plan:  # fmt: skip
    """The engine plan of a request: one chat choice, its reasoning split off."""
    messages, kwargs, tools = await conversation(req, tool_format, reasoning, limits, prep)
    budget = req.thinking.budget_tokens if req.thinking is not None else None
    if budget is not None and tools is not None and tools.forced:
        raise OpenAIError(400, 'tool_choice forcing a tool ("any" or "tool") cannot be '
                          'combined with thinking {"type": "enabled"}: the call\'s grammar '
                          "holds the reply from its first token; use auto", "tool_choice")  # fmt: skip
    sampling = GenerationRequest(temperature=req.temperature, top_p=req.top_p,
                                 top_k=req.top_k, seed=req.seed,
                                 stop=req.stop_sequences)  # fmt: skip
    try:
        guide = await job_guide(sampling, tools, limits, prep)
    except OpenAIError as exc:
        raise _renamed(exc) from None
    conv = Conversation(messages, kwargs, tools, req.max_tokens, "max_tokens", "messages")
    tool_plan = tools.plan(tool_format) if tools else None
    kept = tool_plan.kept_token_ids(client.tokenizer) if tool_plan else ()
    if reasoning is not None:
        kept += reasoning.kept_token_ids(client.tokenizer)
    job = await conversation_job(sampling, conv, client, req.max_tokens, guide, prep, n=1,
                                 kept_special_ids=kept)  # fmt: skip
    split = reasoning_of(reasoning, client, job)
    job = with_thinking_budget(job, split, budget, client, "thinking.budget_tokens")
    return Plan("chat", [job], 1, 1, stream=bool(req.stream), tools=tool_plan, reasoning=split)
