"""The request side of the Responses API (``POST /v1/responses``): the body, the fields
refused by name, and the chat conversation a request runs as.

A request runs through the chat path's pieces. Its items, after the stored
conversation of ``previous_response_id``, become template messages: ``instructions`` a
system message at the start, ``function_call`` items the assistant's ``tool_calls``,
``function_call_output`` items ``tool`` messages, ``reasoning`` items the next
assistant message's ``reasoning_content`` (the template keeps or drops it), and
``reasoning.effort`` sets the template's thinking switch. Function tools are checked by
`tool_request.check_tools` in the Responses shape (``{"type": "function", "name", ...}``),
``text.format`` becomes the structured-output guide, and a forced ``tool_choice`` the
grammar of a call. A turn's prompt thus begins with the previous turn's prompt and
reply, so the prefix cache serves that part.

Contract: every field of OpenAI's API is either served, accepted as the value that
turns it off (``background: false``, ``include: []`` ...), or refused with a 400 that
names it and says what to send instead (`REFUSED`); unknown fields are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema

from radixserve.runtime.engine_client import EngineClient
from radixserve.services.gateway.openai_api.fields import (
    TOKEN_COUNT,
    Body,
    CacheSalt,
    Priority,
    PromptCacheKey,
    RequestTimeout,
    Text,
)
from radixserve.services.gateway.openai_api.limits import PrepareLimits
from radixserve.services.gateway.openai_api.plan import (
    Conversation,
    Plan,
    conversation_job,
    effort_variables,
    job_guide,
)
from radixserve.services.gateway.openai_api.preparer import Preparation
from radixserve.services.gateway.openai_api.schemas import TOOLS_SCHEMA as CHAT_TOOLS_SCHEMA
from radixserve.services.gateway.openai_api.schemas import (
    FunctionCall,
    GenerationRequest,
    ResponseFormat,
    ToolCall,
)
from radixserve.services.gateway.responses_api.output import new_id
from radixserve.services.gateway.server.errors import OpenAIError, validated
from radixserve.services.gateway.tools.reasoning import ReasoningFormat
from radixserve.services.gateway.tools.tool_request import (
    RESPONSES_TOOLS,
    ToolFormat,
    check_tools,
    with_tools,
)

MAX_ITEMS = 4096  # input items per request, as chat's messages
_NAME = r"^[A-Za-z0-9_-]{1,64}$"

#: OpenAI fields radixserve does not serve -> (the values that turn them off, why and
#: what to send instead); an "off" value is accepted, anything else refused by name
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((False,), "true is not served: a response runs while its request is "
                   "open; send false or leave it out"),
    "conversation": ((), "is not served: continue a conversation with "
                     "previous_response_id"),
    "prompt": ((), "(a stored prompt template) is not served: send the text as input "
               "and instructions"),
    "include": (([],), "lists extra output data radixserve does not produce: send [] or "
                "leave it out"),
    "max_tool_calls": ((), "is not served (it bounds built-in tool calls, which "
                       "radixserve does not run); leave it out"),
    "top_logprobs": ((0,), "is not served on /v1/responses: use /v1/chat/completions "
                     "with logprobs, or leave it out"),
    "truncation": (("disabled",), '"auto" is not served: an input over the context is '
                   'refused instead; send "disabled" or leave it out'),
    "context_management": (([],), "is not served; leave it out"),
    "prompt_cache_retention": (("in_memory",), 'can only be "in_memory" (the prefix '
                               "cache lives in the workers' memory)"),
    "prompt_cache_options": ((), "is not served: the prefix cache is automatic; leave it "
                             "out"),
    "background_options": ((), "is not served (no background responses); leave it out"),
    "image": ((), "is not served (text models only); leave it out"),
    "moderation": ((), "is not served; leave it out"),
    "access_programs": ((), "is not served; leave it out"),
}  # fmt: skip
#: item types of OpenAI's input radixserve does not take -> why
_REFUSED_ITEMS = {
    "item_reference": "is not served: continue a stored conversation with "
    "previous_response_id, or send the items themselves",
}


def _is_off(value: Any, offs: tuple[Any, ...]) -> bool:
    return value is None or any(type(value) is type(off) and value == off for off in offs)


def _without_refused(body: dict[str, Any]) -> dict[str, Any]:
    """The body without the unserved fields that are off; raises `OpenAIError` naming
    the first one that is on."""
    for name, (offs, why) in REFUSED.items():
        if name in body and not _is_off(body[name], offs):
            raise OpenAIError(400, f"{name} {why}", name)
    return {k: v for k, v in body.items() if k not in REFUSED}


class ContentPart(Body):
    type: Literal["input_text", "output_text"] = Field(
        description="Text only: images, audio and files are not served."
    )
    text: str
    annotations: list[Any] | None = Field(
        None, description="An output_text part sent back as history: not read."
    )
    logprobs: list[Any] | None = Field(None, description="As annotations: not read.")


Content = str | Annotated[list[ContentPart], Field(max_length=256)]
ItemId = Annotated[str, Field(min_length=1, max_length=256)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: ItemId | None = Field(None, description="An output item's id sent back: not read.")
    status: ItemStatus | None = None


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: ItemId
    name: str = Field(pattern=_NAME)
    arguments: str = Field(max_length=1 << 20, description="The arguments as JSON text.")
    id: ItemId | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: ItemId = Field(description="The function_call this answers.")
    output: Content
    id: ItemId | None = None
    status: ItemStatus | None = None


class ReasoningText(Body):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(Body):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(Body):
    """A reply's reasoning sent back: given to the chat template as the next assistant
    message's ``reasoning_content`` (which the template keeps or drops)."""

    type: Literal["reasoning"]
    content: Annotated[list[ReasoningText], Field(max_length=256)] | None = None
    summary: Annotated[list[SummaryText], Field(max_length=256)] = Field(
        default_factory=list, description="Not read (radixserve writes no summaries)."
    )
    encrypted_content: None = Field(None, description="Not served: only null.")
    id: ItemId | None = None
    status: ItemStatus | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


def input_item(raw: Any, where: str) -> InputItem:
    """One item of ``input`` (or of a response's output), checked; errors name `where`."""
    if not isinstance(raw, dict):
        raise OpenAIError(400, f"{where} must be an object: a message ({{\"role\", "
                          '"content"}), a function_call, a function_call_output or a reasoning item',
                          where)  # fmt: skip
    kind = raw.get("type") or "message"
    if kind in _REFUSED_ITEMS or kind not in _ITEMS:
        why = _REFUSED_ITEMS.get(kind, "is not served")
        raise OpenAIError(400, f"{where}.type {kind!r} {why} (accepted: message, "
                          "function_call, function_call_output, reasoning)",
                          f"{where}.type")  # fmt: skip
    return validated(_ITEMS[kind], raw, where)


def _text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def canonical(item: InputItem) -> dict[str, Any]:
    """The item as the store keeps it: what the prompt is made from, and its id (the
    one it was sent with, else a new one) for the listing of input items."""
    if isinstance(item, MessageItem):
        return {"id": item.id or new_id("msg"), "type": "message", "role": item.role,
                "content": _text(item.content)}  # fmt: skip
    if isinstance(item, FunctionCallItem):
        return {"id": item.id or new_id("fc"), "type": "function_call",
                "call_id": item.call_id, "name": item.name, "arguments": item.arguments}  # fmt: skip
    if isinstance(item, ReasoningItem):
        text = "".join(part.text for part in item.content or ())
        return {"id": item.id or new_id("rs"), "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip
    return {"id": item.id or new_id("fco"), "type": "function_call_output",
            "call_id": item.call_id, "output": _text(item.output)}  # fmt: skip


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=_NAME)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> ResponseFormat | None:
        """The chat path's equivalent (its schema is checked and compiled by
        `response_plan`)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        if self.schema_ is None:
            raise OpenAIError(400, 'text.format.schema is required when text.format.type is '
                              '"json_schema"', "text.format.schema")  # fmt: skip
        spec = {"name": self.name or "response", "schema": self.schema_}
        return ResponseFormat.model_validate({"type": "json_schema", "json_schema": spec})


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: None = Field(None, description="Not served: only null.")


class ReasoningConfig(Body):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="Set through the chat template's thinking switch (none and "
        "minimal: off; low, medium, high: on); a model whose template has none accepts "
        "only medium (its own behaviour).",
    )  # fmt: skip
    summary: None = Field(None, description="Not served (no summaries are written): only null.")
    generate_summary: None = Field(None, description="Not served: only null.")


class ResponseStreamOptions(Body):
    include_obfuscation: Literal[False] | None = Field(
        None, description="Events carry no obfuscation field: only false."
    )


_FUNCTION = CHAT_TOOLS_SCHEMA["items"]["properties"]["function"]
#: the documented shapes of `tools` and `tool_choice`: chat's, with the function's
#: fields beside "type"; `tool_request.check_tools` checks them itself, so that a mistake is
#: refused with a sentence naming the field
TOOLS_SCHEMA = {**CHAT_TOOLS_SCHEMA, "items": {
    "type": "object", "required": ["type", "name"], "additionalProperties": False,
    "properties": {"type": {"const": "function"}, **_FUNCTION["properties"]}}}  # fmt: skip
TOOL_CHOICE_SCHEMA = {"anyOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "name"], "additionalProperties": False,
    "properties": {"type": {"const": "function"},
                   "name": _FUNCTION["properties"]["name"]}}]}  # fmt: skip


class ResponsesRequest(Body):
    """``POST /v1/responses``. Build with `checked` (refusals and items first)."""

    model: str | None = Field(None, max_length=256, description="A served name or 'default'.")
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS)] = Field(
        description="A user message's text, or items: messages, function_call and "
        "function_call_output."
    )
    instructions: str | None = Field(None, description="A system message before the input.")
    previous_response_id: str | None = Field(
        None, min_length=1, max_length=256, description="Continue this stored response."
    )
    max_output_tokens: TOKEN_COUNT | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: Annotated[list[dict[str, Any]], WithJsonSchema(TOOLS_SCHEMA)] | None = Field(
        None, description='Function tools: {"type": "function", "name", "description", '
        '"parameters" (a JSON schema), "strict"}.',
    )  # fmt: skip
    tool_choice: Annotated[str | dict[str, Any], WithJsonSchema(TOOL_CHOICE_SCHEMA)] | None = (
        Field(None, description='"none", "auto" (the default with tools), "required", or '
              '{"type": "function", "name": ...}.')
    )  # fmt: skip
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    stream_options: ResponseStreamOptions | None = None
    store: bool | None = Field(True, description="Keep the response (GET, continuation).")
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = Field(
        None, description="Returned with the response."
    )
    user: str | None = Field(None, max_length=256, description="Ignored (as by OpenAI).")
    safety_identifier: str | None = Field(None, max_length=256, description="Ignored.")
    prompt_cache_key: PromptCacheKey = None
    cache_salt: CacheSalt = None
    priority: Priority = None
    service_tier: Literal["auto", "default"] | None = Field(None, description="Ignored.")
    timeout: RequestTimeout = None

    @classmethod
    def checked(cls, body: dict[str, Any]) -> ResponsesRequest:
        """The request in `body`: unserved fields refused (or dropped when off), each
        input item checked under its own name, then the rest."""
        body = _without_refused(body)
        items = body.get("input")
        if isinstance(items, list) and len(items) <= MAX_ITEMS:
            body = {**body, "input": [input_item(raw, f"input[{i}]") for i, raw in
                                      enumerate(items)]}  # fmt: skip
        return cls.model_validate(body)

    @property
    def stored(self) -> bool:
        return self.store is not False

    def items(self) -> list[dict[str, Any]]:
        """This request's input as stored items."""
        if isinstance(self.input, str):
            return [{"id": new_id("msg"), "type": "message", "role": "user",
                     "content": self.input}]  # fmt: skip
        return [canonical(item) for item in self.input]

    def echo(self) -> dict[str, Any]:
        """The request fields a response object repeats."""
        fmt = self.text.format if self.text and self.text.format else None
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "store": self.stored,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "tools": self.tools or [],
            "tool_choice": "auto" if self.tool_choice is None else self.tool_choice,
            "metadata": self.metadata or {},
            "user": self.user,
            "reasoning": {"effort": self.effort, "summary": None},
        }  # fmt: skip

    @property
    def effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning else None


def _messages(instructions: str | None, items: list[dict[str, Any]], first_new: int
              ) -> list[dict[str, Any]]:  # fmt: skip
    """The conversation as chat template messages (see the module docstring); raises
    `OpenAIError` for an output that answers no call."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    calls: set[str] = set()
    thought: dict[str, Any] | None = None  # the turn a reasoning item just opened
    for i, item in enumerate(items):
        opened, thought = thought, None
        if item["type"] == "reasoning":  # the reasoning of the assistant turn it opens
            text = "".join(part["text"] for part in item["content"])
            thought = {"role": "assistant", "content": "", "reasoning_content": text}
            messages.append(thought)
        elif item["type"] == "message" and opened is not None and item["role"] == "assistant":
            opened["content"] = item["content"]
        elif item["type"] == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": item["content"]})
        elif item["type"] == "function_call":
            calls.add(item["call_id"])
            function = FunctionCall(name=item["name"], arguments=item["arguments"])
            call = ToolCall(id=item["call_id"], type="function", function=function)
            if messages and messages[-1]["role"] == "assistant":  # a reply's text and calls
                messages[-1].setdefault("tool_calls", []).append(call.to_template())
            else:
                messages.append({"role": "assistant", "content": "",
                                 "tool_calls": [call.to_template()]})  # fmt: skip
        else:
            if item["call_id"] not in calls:
                where = f"input[{i - first_new}].call_id"
                raise OpenAIError(400, f"{where} {item['call_id']!r} answers no function_call "
                                  "of the conversation: send the function_call item before "
                                  "it, or continue its response with previous_response_id",
                                  where)  # fmt: skip
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]})  # fmt: skip
    return messages


async def response_plan(
    req: ResponsesRequest,
    history: list[dict[str, Any]],
    client: EngineClient,
    default_max_tokens: int,
    tool_format: ToolFormat,
    limits: PrepareLimits,
    prep: Preparation,
    reasoning: ReasoningFormat | None = None,
) -> Plan:
    """The engine plan of a request continuing `history` (the stored items of its
    previous response, or none): one chat choice; ``reasoning.effort`` sets the
    template's thinking switch (`ReasoningFormat.effort_variables`)."""
    fmt = req.text.format if req.text and req.text.format else None
    response_format = fmt.response_format() if fmt else None
    tools = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                        response_format is not None, RESPONSES_TOOLS, limits)  # fmt: skip
    sampling = GenerationRequest(temperature=req.temperature, top_p=req.top_p,
                                 response_format=response_format)  # fmt: skip
    guide = await job_guide(sampling, tools, limits, prep, "text.format.schema")
    messages = _messages(req.instructions, [*history, *req.items()], len(history))
    switch = effort_variables(reasoning, req.effort, {}, "reasoning.effort")
    messages, template_kwargs = await prep.run("input", with_tools, messages, switch, tools,
                                               tool_format)  # fmt: skip
    conv = Conversation(messages, template_kwargs, tools, req.max_output_tokens,
                        "max_output_tokens", "input")  # fmt: skip
    job, tool_plan, split = await conversation_job(
        sampling, conv, client, default_max_tokens, guide, prep, tool_format, reasoning, n=1
    )
    return Plan("chat", [job], 1, 1, stream=bool(req.stream), tools=tool_plan,
                reasoning=split, cache_salt=req.cache_salt or "",
                prompt_cache_key=req.prompt_cache_key or "", priority=req.priority)  # fmt: skip
