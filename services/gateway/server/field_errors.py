"""Sentences for request validation failures: pydantic's errors turned into one line a
person can act on, naming the field as the request spells it (``messages[0].content``),
what was wrong and what is accepted, e.g. ``temperature must be at most 2, got 3.5``.

pydantic reports a value that matches no member of a union once per member, each under
a tag naming the member's type (``('stop', 'constrained-str')``, ``('stop',
'list[constrained-str]', 0)``). `describe` keeps the member the value came closest to
(one whose type it has, with the fewest errors) and says what it got wrong; when the
value has none of the members' types it lists them all ("a string or a list").
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

Loc = tuple[int | str, ...]

_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "bytes"}
_KINDS = {  # error type -> what the value must be
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "none_required": "null",
    "finite_number": "a finite number",
}
_JSON_WORDS = {"True": "true", "False": "false", "None": "null"}  # a Literal's values as JSON
_PYTHON_WORDS = re.compile(r"\b(True|False|None)\b")
_BOUNDS = {"greater_than_equal": ("ge", "at least"), "greater_than": ("gt", "greater than"),
           "less_than_equal": ("le", "at most"), "less_than": ("lt", "less than")}  # fmt: skip


def _is_tag(part: int | str) -> bool:
    """A union member's tag in a loc (not a field, key or index)."""
    if isinstance(part, int):
        return False
    return part in _TYPE_TAGS or any(c in part for c in "[]-(") or part[:1].isupper()


def param_of(loc: Loc, prefix: str = "") -> str:
    """The field path as the request spells it: ``tools[0].function.name``."""
    out = prefix
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_tag(part):
            continue
        elif _FIELD.fullmatch(part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out


def _number(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _got(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _length(error: dict[str, Any], bound: str, word: str) -> str:
    ctx = error.get("ctx", {})
    count = ctx.get(f"{bound}_length")
    if error["type"].startswith("string"):
        units = ("character", "characters")
    elif ctx.get("field_type") == "Dictionary":
        units = ("entry", "entries")
    else:
        units = ("item", "items")
    got = ctx.get("actual_length")
    tail = f", got {got}" if got is not None else ""
    return f"must have {word} {count} {units[count != 1]}{tail}"


def sentence(error: dict[str, Any]) -> str:
    """What is wrong with the value, as the end of a sentence starting with its field."""
    kind, ctx = error["type"], error.get("ctx", {})
    if kind == "missing":
        return "is required but missing"
    if kind in _KINDS:
        return f"must be {_KINDS[kind]}, got {_got(error.get('input'))}"
    if kind == "literal_error" or kind == "enum":
        expected = str(ctx.get("expected")).replace("'", '"')
        expected = _PYTHON_WORDS.sub(lambda m: _JSON_WORDS[m[0]], expected)
        return f"must be {expected}, got {_got(error.get('input'))}"
    if kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        return f"must be {words} {_number(ctx.get(key))}, got {_got(error.get('input'))}"
    if kind in ("too_short", "string_too_short"):
        return _length(error, "min", "at least")
    if kind in ("too_long", "string_too_long"):
        return _length(error, "max", "at most")
    if kind == "string_pattern_mismatch":
        return f"must match the pattern {ctx.get('pattern')}, got {_got(error.get('input'))}"
    message = str(error.get("msg", "is invalid")).removeprefix("Value error, ")
    return f"is invalid: {message[:1].lower()}{message[1:]}"


def _branch(loc: Loc) -> Loc | None:
    """The loc up to and including its first union tag, if it has one."""
    for i, part in enumerate(loc):
        if _is_tag(part):
            return loc[: i + 1]
    return None


def _root_type_error(error: dict[str, Any], branch: Loc) -> bool:
    return error["type"] in _KINDS and len(error["loc"]) == len(branch)


def _closest(errors: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The error to report, and (when the value has none of a union's member types) the
    kinds the members accept."""
    first = errors[0]
    branch = _branch(first["loc"])
    if branch is None:
        return first, []
    parent = branch[:-1]
    members: dict[Loc, list[dict[str, Any]]] = {}
    for error in errors:
        b = _branch(error["loc"])
        if b is not None and b[:-1] == parent:
            members.setdefault(b, []).append(error)
    matched = [(len(errs), sum(e["type"] in _KINDS for e in errs), errs)
               for b, errs in members.items()
               if not all(_root_type_error(e, b) for e in errs)]  # fmt: skip
    if matched:
        return min(matched, key=lambda m: m[:2])[2][0], []
    kinds = list(dict.fromkeys(_KINDS[e["type"]] for errs in members.values() for e in errs))
    return first, kinds


def describe(errors: Sequence[dict[str, Any]], prefix: str = "") -> tuple[str, str | None]:
    """A one-line message and the offending field for pydantic `errors` (``prefix``: the
    field path the validated value sits at)."""
    if not errors:
        return "invalid request", prefix or None
    error, kinds = _closest(errors)
    param = param_of(error["loc"], prefix)
    if error["type"] == "extra_forbidden":
        return (f"{param} is not a field of this endpoint, or one radixserve does not "
                "implement: remove it", param)  # fmt: skip
    if kinds:
        what = " or ".join(kinds)
        text = f"must be {what}, got {_got(error.get('input'))}"
    else:
        text = sentence(error)
    return (f"{param} {text}" if param else f"the request body {text}"), param or None
