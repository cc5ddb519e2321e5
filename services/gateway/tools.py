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

import jinja2
import jinja2.ext
import jinja2.meta

from radixserve.engine.grammar import grammar_for
from radixserve.errors import InvalidRequestError
from radixserve.services.gateway.errors import OpenAIError
from radixserve.services.gateway.schemas import ChatCompletionRequest
from radixserve.services.gateway.tool_calls import PARSERS, ToolCallStream, parser_for_template

MAX_TOOLS = 128  # as OpenAI's bound
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
        native = False
        if source:
            env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
            try:
                native = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
            except jinja2.TemplateError:
                native = False
        parser = parser_for_template(source if native else None) if setting == "auto" else setting
        return cls(native, parser)


@dataclass(frozen=True)
class ToolPlan:
    """What the response side needs: how to find calls and which names are real."""

    parser: str
    names: frozenset[str]
    single: bool  # parallel_tool_calls false: at most one call is returned

    def stream(self) -> ToolCallStream:
        return ToolCallStream(PARSERS[self.parser], self.names, self.single)


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools: the tool objects, the choice ("auto", "required" or a
    function's name) and whether several calls may come back."""

    tools: list[dict[str, Any]]
    choice: str
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def plan(self, fmt: ToolFormat) -> ToolPlan:
        names = frozenset(t["function"]["name"] for t in self.tools)
        single = not self.parallel or self.forced
        return ToolPlan("json" if self.forced else fmt.parser, names, single)

    def guide(self) -> str:
        """The JSON schema (text) a forced reply must match; raises `OpenAIError` naming
        the tool whose parameters cannot be compiled."""
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
        guide = json.dumps(schema)
        try:
            grammar_for("json_schema", guide)
        except InvalidRequestError as exc:
            param = "tools"
            for i, tool in enumerate(self.tools):
                try:
                    grammar_for("json_schema", json.dumps(tool["function"].get("parameters") or {}))
                except InvalidRequestError:
                    param = f"tools[{i}].function.parameters"
                    break
            raise OpenAIError(400, f"{param}: the parameters schema cannot be enforced: {exc}",
                              param) from None  # fmt: skip
        return guide


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param} {message}", param)


def _check_tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise _bad(where, "must be an object")
    if tool.get("type") != "function":
        raise _bad(f"{where}.type", f'must be "function" (the only tool type served), got '
                   f"{tool.get('type')!r}")  # fmt: skip
    for key in tool:
        if key not in ("type", "function"):
            raise _bad(f"{where}.{key}", "is not a field of a function tool")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{where}.function", "must be an object with the function's name")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{where}.function.name", "must be 1 to 64 letters, digits, underscores "
                   f"or dashes, got {name!r}")  # fmt: skip
    for key in function:
        if key not in _FUNCTION_KEYS:
            raise _bad(f"{where}.function.{key}", "is not a field of a function")
    for key, kind, label in (("description", str, "a string"), ("parameters", dict,
                             "a JSON schema object"), ("strict", bool, "a boolean")):  # fmt: skip
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise _bad(f"{where}.function.{key}", f"must be {label}")
    return tool


def _choice(value: Any, names: list[str]) -> str:
    """The checked tool_choice: "none", "auto", "required" or a function's name."""
    if value is None:
        return "auto" if names else "none"
    if isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type") != "function" or not isinstance(name, str) or set(value) != {
            "type", "function"}:  # fmt: skip
            raise _bad("tool_choice", 'as an object must be {"type": "function", '
                       '"function": {"name": ...}}')  # fmt: skip
        if name not in names:
            raise _bad("tool_choice", f"names the function {name!r}, which is not in tools")
        return name
    if value not in ("none", "auto", "required"):
        raise _bad("tool_choice", 'must be "none", "auto", "required" or {"type": '
                   f'"function", "function": {{"name": ...}}}}, got {value!r}')  # fmt: skip
    if value != "none" and not names:
        raise _bad("tool_choice", f"is {value!r} but the request gives no tools")
    return str(value)


def tool_request(req: ChatCompletionRequest) -> ToolRequest | None:
    """The request's checked tools, or None when no tool may be called (none given, or
    tool_choice "none"); raises `OpenAIError` naming the bad field."""
    if len(req.tools or ()) > MAX_TOOLS:
        raise _bad("tools", f"lists {len(req.tools or ())} tools; at most {MAX_TOOLS} are served")
    tools = [_check_tool(t, i) for i, t in enumerate(req.tools or [])]
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _bad(f"tools[{i}].function.name", f"{name!r} is given twice")
    choice = _choice(req.tool_choice, names)
    if choice == "none":
        return None
    if choice == "auto":  # strict arguments are a grammar, and "auto" constrains nothing
        for i, tool in enumerate(tools):
            if tool["function"].get("strict"):
                raise _bad(f"tools[{i}].function.strict", 'is enforced only when the call '
                           'is forced: use tool_choice "required" or name the function')  # fmt: skip
    tools_req = ToolRequest(tools, choice, req.parallel_tool_calls is not False)
    if tools_req.forced and req.guide()[0]:
        raise _bad("tool_choice", f"{req.tool_choice!r} cannot be combined with "
                   "response_format or guided_*: both constrain the reply")  # fmt: skip
    return tools_req


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
    req: ChatCompletionRequest, tools: ToolRequest | None, fmt: ToolFormat
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for the request's prompt."""
    messages = req.template_messages()
    kwargs = req.template_kwargs()
    if "tools" in kwargs:
        raise _bad("chat_template_kwargs", "cannot set 'tools': give them as the tools field")
    if fmt.native:
        if tools is not None:
            kwargs["tools"] = tools.tools
        return messages, kwargs
    return generic_messages(messages, tools.tools if tools else None), kwargs
