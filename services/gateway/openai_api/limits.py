"""Size caps on what a request asks the gateway to compile or render: checked before any
of it is compiled, rendered or tokenized, each refusal a 400 naming the field.

The caps (`GatewaySettings`' ``max_schema_bytes`` ... ``max_guided_grammar_chars``)
are sized well above legitimate use: a JSON schema is a few KiB (OpenAI's structured
outputs allow 100 object properties and 5 levels of nesting), a tool's parameters
about as much; what they keep out is the multi-MiB document whose compilation would
hold a preparation worker for seconds. Sizes are measured on the text that would be
compiled (schemas as the gateway serializes them, in UTF-8 bytes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixserve.engine.sampling_params import MAX_GUIDE_CHARS
from radixserve.services.gateway.server.errors import OpenAIError


def _too_big(param: str, what: str, size: int, limit: int, setting: str) -> OpenAIError:
    return OpenAIError(400, f"{param} is too large: {what} is {size}, the gateway accepts at "
                       f"most {limit} ({setting})", param)  # fmt: skip


def _schema_bytes(value: Any) -> int:
    return len(json.dumps(value).encode("utf-8"))


@dataclass(frozen=True)
class PrepareLimits:
    """The caps (see `GatewaySettings` for each one's meaning)."""

    max_schema_bytes: int
    max_tools: int
    max_tool_parameters_bytes: int
    max_guided_choices: int
    max_guided_choice_chars: int
    max_guided_regex_chars: int
    max_guided_grammar_chars: int

    def check_guide(self, param: str, kind: str, guide: str) -> None:
        """A structured-output guide of `kind` from the request field `param`."""
        if kind == "json_schema":
            size = len(guide.encode("utf-8"))
            if size > self.max_schema_bytes:
                raise _too_big(param, "the JSON schema's size in bytes", size,
                               self.max_schema_bytes, "max_schema_bytes")  # fmt: skip
        elif kind == "choice":
            self._check_choices(param, json.loads(guide))
        elif kind in ("regex", "lark"):
            setting = "max_guided_regex_chars" if kind == "regex" else "max_guided_grammar_chars"
            limit = getattr(self, setting)
            if len(guide) > limit:
                raise _too_big(param, "its length in characters", len(guide), limit, setting)
        if len(guide) > MAX_GUIDE_CHARS:  # the engine's own bound on any guide
            raise _too_big(param, "the guide's length in characters", len(guide),
                           MAX_GUIDE_CHARS, "the engine's guide bound")  # fmt: skip

    def _check_choices(self, param: str, choices: list[str]) -> None:
        if len(choices) > self.max_guided_choices:
            raise _too_big(param, "the number of choices", len(choices),
                           self.max_guided_choices, "max_guided_choices")  # fmt: skip
        for i, choice in enumerate(choices):
            if len(choice) > self.max_guided_choice_chars:
                raise _too_big(f"{param}[{i}]", "its length in characters", len(choice),
                               self.max_guided_choice_chars, "max_guided_choice_chars")  # fmt: skip

    def check_tool_count(self, count: int) -> None:
        if count > self.max_tools:
            raise _too_big("tools", "the number of tools", count, self.max_tools, "max_tools")

    def check_tool_parameters(self, tools: list[dict[str, Any]], function_param: Any) -> None:
        """Each checked tool's ``parameters`` schema (tools in chat's nested shape);
        ``function_param(i)`` names tool i's function fields as the request sent them."""
        for i, tool in enumerate(tools):
            parameters = tool["function"].get("parameters")
            if parameters is None:
                continue
            size = _schema_bytes(parameters)
            if size > self.max_tool_parameters_bytes:
                raise _too_big(f"{function_param(i)}.parameters",
                               "the parameters schema's size in bytes", size,
                               self.max_tool_parameters_bytes, "max_tool_parameters_bytes")  # fmt: skip

    def check_tool_guide(self, guide: str) -> None:
        """The schema a forced tool call is held to (every forced tool's parameters)."""
        size = len(guide.encode("utf-8"))
        if size > self.max_schema_bytes:
            raise _too_big("tools", "the forced call's schema (the parameters of every tool "
                           "it may call) in bytes", size, self.max_schema_bytes,
                           "max_schema_bytes")  # fmt: skip
