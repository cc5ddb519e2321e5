"""A guide's grammar: JSON schema, JSON object, regex, choice or Lark text turned into an
llguidance grammar and checked, without a tokenizer or torch (the gateway refuses a
malformed guide before routing; `structured` compiles it against the vocabulary).
JSON is generated with compact separators."""

from __future__ import annotations

import json
from typing import Any

from radixserve.errors import InvalidRequestError

PARAM = "response_format"  # the request field a guide comes from
# Compact separators: with free whitespace a small model can loop on blank space forever.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}


def _json_list(text: str) -> list[str]:
    try:
        choices = json.loads(text)
    except ValueError:
        choices = None
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise InvalidRequestError(
            "guided_choice must be a non-empty list of non-empty strings", param="guided_choice"
        )
    return choices


def grammar_for(kind: str, guide: str) -> str:
    """The llguidance grammar of a guide; raises `InvalidRequestError` if it is malformed
    (checked without a tokenizer, so the gateway can refuse it before routing)."""
    import llguidance

    param = PARAM
    if kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_OPTIONS
        )
    elif kind == "json_schema":
        try:
            schema = json.loads(guide)
        except ValueError as exc:
            raise InvalidRequestError(f"the JSON schema is not JSON: {exc}", param=param) from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("a JSON schema must be an object", param=param)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(guide, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidRequestError(f"invalid JSON schema: {exc}", param=param) from None
    elif kind == "regex":
        param = "guided_regex"
        grammar = llguidance.LLMatcher.grammar_from_regex(guide)
    elif kind == "choice":
        param = "guided_choice"
        alternatives = "|".join(json.dumps(c) for c in _json_list(guide))
        grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    elif kind == "lark":
        param = "guided_grammar"
        grammar = llguidance.LLMatcher.grammar_from_lark(guide)
    else:
        raise InvalidRequestError(f"unknown guide kind {kind!r}", param=param)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise InvalidRequestError(f"{param}: cannot compile the {kind} guide: {error[:500]}",
                                  param=param)  # fmt: skip
    return grammar
