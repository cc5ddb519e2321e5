"""Tool calling on the request side: checking ``tools`` and ``tool_choice``, putting the
tools and the conversation's calls into the prompt, and the grammar that forces a call.

Rendering (`ToolFormat`, decided once per model from its chat template):

* a template that reads the Jinja variable ``tools`` renders them itself: it gets the
  request's tool objects as given (as transformers' ``apply_chat_template(...,
  tools=...)`` passes them) and the history as is (assistant ``tool_calls`` with
  ``function.arguments`` as an object when it holds one, ``tool`` messages);
* any other template gets the generic rendering (`generic_messages`): a system block
  listing the tools' JSON and asking for ``<tool_call>{"name": ..., "arguments":
  ...}</tool_call>`` (Hermes' wording), earlier calls written that way into the
  assistant's text, and tool results as a user turn of ``<tool_response>`` blocks.

``tool_choice``: ``none`` renders no tools and parses nothing; ``auto`` (the default
with tools) lets the model choose and parses its reply; ``required`` and a named
function constrain the reply with a JSON-schema guide (the engine that serves
``response_format``) to one ``{"name", "arguments"}`` object whose arguments validate
against that function's ``parameters`` (``required`` with several tools: any of them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from radixserve.engine.grammar import grammar_for
from radixserve.errors import InvalidRequestError
from radixserve.model.tokenizer import Tokenizer
from radixserve.services.gateway.openai_api.limits import PrepareLimits
from radixserve.services.gateway.openai_api.schemas import ChatCompletionRequest, TokenizeRequest
from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.services.gateway.tools.reasoning import template_variables
from radixserve.services.gateway.tools.tool_calls import PARSERS, parser_for_template
from radixserve.services.gateway.tools.tool_stream import ToolCallStream

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}

GENERIC_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolFormat:
    """How this model's prompts carry tools and which parser reads its replies."""

    native: bool  # the chat template renders the `tools` variable itself
    parser: str  # a key of `PARSERS`

    @classmethod
    def for_template(cls, source: str | None, setting: str = "auto") -> ToolFormat:
        native = "tools" in template_variables(source)
        parser = parser_for_template(source if native else None) if setting == "auto" else setting
        return cls(native, parser)


@dataclass(frozen=True)
class ToolPlan:
    """What the response side needs: how to find calls and which names are real."""

    parser: str
    names: frozenset[str]
    single: bool  # parallel_tool_calls false: at most one call is returned

    def kept_token_ids(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        """The parser's marker tokens in this vocabulary, for the decode to keep in the
        text (Llama 3's ``<|python_tag|>`` and Mistral's ``[TOOL_CALLS]`` are special
        tokens, left out of the text otherwise)."""
        ids = (tokenizer.token_to_id(token) for token in PARSERS[self.parser].tokens)
        return tuple(i for i in ids if i is not None)

    def stream(self, incremental: bool) -> ToolCallStream:
        """A choice's splitter; `incremental` for a streamed choice (its calls' arguments
        go out as they are generated)."""
        return ToolCallStream(PARSERS[self.parser], self.names, self.single, incremental)


@dataclass(frozen=True)
class ToolSyntax:
    """Where an API puts a function tool's fields, so that errors name them as sent:
    chat nests them under ``function`` (also in ``tool_choice``), the Responses API
    puts them beside ``type``."""

    nested: bool
    constraint: str  # the fields a structured-output constraint comes from

    def function_param(self, i: int) -> str:
        return f"tools[{i}].function" if self.nested else f"tools[{i}]"

    @property
    def choice_shape(self) -> str:
        inner = '"function": {"name": ...}' if self.nested else '"name": ...'
        return f'{{"type": "function", {inner}}}'


CHAT_TOOLS = ToolSyntax(nested=True, constraint="response_format or guided_*")
RESPONSES_TOOLS = ToolSyntax(nested=False, constraint="text.format")


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools (in chat's nested shape, as templates read them): the
    tool objects, the choice ("auto", "required" or a function's name) and whether
    several calls may come back."""

    tools: list[dict[str, Any]]
    choice: str
    parallel: bool
    syntax: ToolSyntax = CHAT_TOOLS

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def plan(self, fmt: ToolFormat) -> ToolPlan:
        names = frozenset(t["function"]["name"] for t in self.tools)
        single = not self.parallel or self.forced
        return ToolPlan("json" if self.forced else fmt.parser, names, single)

    def guide(self) -> str:
        """The JSON schema (text) a forced reply must match: one ``{"name",
        "arguments"}`` object of a tool it may call (`compile_guide` checks it)."""
        alternatives = []
        for tool in self.tools:
            function = tool["function"]
            if self.choice in ("required", function["name"]):
                alternatives.append({
                    "type": "object",
                    "properties": {"name": {"const": function["name"]},
                                   "arguments": function.get("parameters") or {"type": "object"}},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                })  # fmt: skip
        schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
        return json.dumps(schema)

    def compile_guide(self, guide: str) -> None:
        """Compile `guide` (from `guide`); raises `OpenAIError` naming the tool whose
        parameters cannot be compiled. CPU work: the gateway runs it in its `Preparer`."""
        try:
            grammar_for("json_schema", guide)
        except InvalidRequestError as exc:
            param = "tools"
            for i, tool in enumerate(self.tools):
                try:
                    grammar_for("json_schema", json.dumps(tool["function"].get("parameters") or {}))
                except InvalidRequestError:
                    param = f"{self.syntax.function_param(i)}.parameters"
                    break
            raise OpenAIError(400, f"{param}: the parameters schema cannot be enforced: {exc}",
                              param) from None  # fmt: skip


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param} {message}", param)


def _check_function(function: dict[str, Any], where: str, own_keys: set[str]) -> None:
    """A function's fields at `where` (`own_keys`: the other keys its object may hold)."""
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{where}.name", "must be 1 to 64 letters, digits, underscores or dashes, "
                   f"got {name!r}")  # fmt: skip
    for key in function:
        if key not in _FUNCTION_KEYS | own_keys:
            raise _bad(f"{where}.{key}", "is not a field of a function tool (accepted: "
                       "name, description, parameters, strict)")  # fmt: skip
    for key, kind, label in (("description", str, "a string"), ("parameters", dict,
                             "a JSON schema object"), ("strict", bool, "a boolean")):  # fmt: skip
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise _bad(f"{where}.{key}", f"must be {label}")


def _check_tool(tool: Any, i: int, syntax: ToolSyntax) -> dict[str, Any]:
    """The tool in chat's nested shape, checked as `syntax` lays it out."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise _bad(where, "must be an object")
    if tool.get("type") != "function":
        raise _bad(f"{where}.type", f'must be "function" (the only tool type served: '
                   f"radixserve runs no built-in tools), got {tool.get('type')!r}")  # fmt: skip
    if not syntax.nested:
        if "function" in tool:
            raise _bad(f"{where}.function", 'is chat\'s shape: here a function tool has its '
                       'fields beside "type": {"type": "function", "name", "description", '
                       '"parameters"}')  # fmt: skip
        _check_function(tool, where, {"type"})
        return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
    for key in tool:
        if key not in ("type", "function"):
            raise _bad(f"{where}.{key}", "is not a field of a function tool (accepted: type, "
                       "function)")  # fmt: skip
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{where}.function", "must be an object with the function's name")
    _check_function(function, f"{where}.function", set())
    return tool


def _choice_name(value: dict[str, Any], syntax: ToolSyntax) -> str | None:
    """The function an object tool_choice names, if it has `syntax`'s shape."""
    if value.get("type") != "function":
        return None
    if not syntax.nested:
        name = value.get("name")
        return name if isinstance(name, str) and set(value) == {"type", "name"} else None
    function = value.get("function")
    if not isinstance(function, dict) or set(value) != {"type", "function"}:
        return None
    name = function.get("name")
    return name if isinstance(name, str) and set(function) == {"name"} else None


def _choice(value: Any, names: list[str], syntax: ToolSyntax) -> str:
    """The checked tool_choice: "none", "auto", "required" or a function's name."""
    if value is None:
        return "auto" if names else "none"
    if isinstance(value, dict):
        name = _choice_name(value, syntax)
        if name is None:
            raise _bad("tool_choice", f"as an object must be {syntax.choice_shape} (only "
                       f"function tools are served), got {json.dumps(value)[:200]}")  # fmt: skip
        if name not in names:
            raise _bad("tool_choice", f"names the function {name!r}, which is not in tools")
        return name
    if value not in ("none", "auto", "required"):
        raise _bad("tool_choice", f'must be "none", "auto", "required" or '
                   f"{syntax.choice_shape}, got {value!r}")  # fmt: skip
    if value != "none" and not names:
        raise _bad("tool_choice", f"is {value!r} but the request gives no tools")
    return str(value)


def check_tools(
    given: list[Any] | None,
    tool_choice: Any,
    parallel: bool | None,
    constrained: bool,
    syntax: ToolSyntax,
    limits: PrepareLimits,
) -> ToolRequest | None:
    """The checked tools of a request, or None when no tool may be called (none given,
    or tool_choice "none"); raises `OpenAIError` naming the bad field as `syntax` lays
    it out. `constrained`: the request also asks for structured output. `limits` are
    checked before anything is rendered or compiled."""
    limits.check_tool_count(len(given or ()))
    tools = [_check_tool(t, i, syntax) for i, t in enumerate(given or [])]
    limits.check_tool_parameters(tools, syntax.function_param)
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _bad(f"{syntax.function_param(i)}.name", f"{name!r} is given twice")
    choice = _choice(tool_choice, names, syntax)
    if choice == "none":
        return None
    if choice == "auto":  # strict arguments are a grammar, and "auto" constrains nothing
        for i, tool in enumerate(tools):
            if tool["function"].get("strict"):
                raise _bad(f"{syntax.function_param(i)}.strict", "is enforced only when the "
                           'call is forced: use tool_choice "required" or name the function, '
                           "or set strict false")  # fmt: skip
    if choice != "auto" and constrained:
        raise _bad("tool_choice", f"{tool_choice!r} cannot be combined with "
                   f"{syntax.constraint}: both constrain the reply")  # fmt: skip
    return ToolRequest(tools, choice, parallel is not False, syntax)


def tool_request(req: ChatCompletionRequest, limits: PrepareLimits) -> ToolRequest | None:
    """`check_tools` of a chat request."""
    return check_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                       bool(req.guided()[0]), CHAT_TOOLS, limits)  # fmt: skip


def _call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def generic_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        if message["role"] == "tool":
            message.pop("tool_call_id", None)
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results: one turn
                out[-1]["content"] += "\n" + response
                continue
            message = {"role": "user", "content": response, "_tool_results": True}
        elif message.get("tool_calls"):
            calls = [_call_text(call) for call in message.pop("tool_calls")]
            message["content"] = "\n".join([message["content"], *calls] if message["content"]
                                           else calls)  # fmt: skip
        out.append(message)
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        block = GENERIC_TOOLS_PROMPT.format(tools=lines)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def template_inputs(
    req: ChatCompletionRequest | TokenizeRequest, tools: ToolRequest | None, fmt: ToolFormat
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for a chat request's prompt (or the one
    /tokenize shows)."""
    kwargs = req.template_kwargs()
    if "tools" in kwargs:
        raise _bad("chat_template_kwargs", "cannot set 'tools': give them as the tools field")
    return with_tools(req.template_messages(), kwargs, tools, fmt)


def with_tools(
    messages: list[dict[str, Any]],
    kwargs: dict[str, Any],
    tools: ToolRequest | None,
    fmt: ToolFormat,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, template variables) carrying `tools` as the model's template takes
    them: its ``tools`` variable, or the generic rendering."""
    if fmt.native:
        if tools is not None:
            kwargs = {**kwargs, "tools": tools.tools}
        return messages, kwargs
    return generic_messages(messages, tools.tools if tools else None), kwargs
