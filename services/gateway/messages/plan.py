"""A Messages request as the chat path runs it: its conversation as chat template
messages, its tools and thinking in the chat path's terms, the prompt counted
(``count_tokens``) and the engine plan of a generation.

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
from typing import Any

from radixserve.runtime.engine_client import EngineClient
from radixserve.services.gateway.messages.request import (
    CountTokensRequest,
    MessagesPrompt,
    MessagesRequest,
    TextBlock,
    Thinking,
    ThinkingBlock,
    ToolUseBlock,
)
from radixserve.services.gateway.openai_api.limits import PrepareLimits
from radixserve.services.gateway.openai_api.plan import (
    Conversation,
    Plan,
    conversation_job,
    job_guide,
    with_thinking_budget,
)
from radixserve.services.gateway.openai_api.preparer import Preparation
from radixserve.services.gateway.openai_api.schemas import FunctionCall, GenerationRequest, ToolCall
from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.services.gateway.tools.reasoning import DEFAULT_EFFORT, ReasoningFormat
from radixserve.services.gateway.tools.tool_request import (
    RESPONSES_TOOLS,
    ToolFormat,
    ToolRequest,
    check_tools,
    with_tools,
)


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
    job, tool_plan, split = await conversation_job(
        sampling, conv, client, req.max_tokens, guide, prep, tool_format, reasoning, n=1
    )
    job = with_thinking_budget(job, split, budget, client, "thinking.budget_tokens")
    return Plan("chat", [job], 1, 1, stream=bool(req.stream), tools=tool_plan, reasoning=split)
