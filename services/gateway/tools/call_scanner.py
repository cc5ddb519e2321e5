"""`CallScanner`: a tool call's JSON object read as it is generated, each character once,
for where its function name and its arguments lie, so that the arguments can stream
before the object (or the reply) has ended.

The object is ``{"name": "...", "arguments": {...}}`` with its keys in any order (other
keys are skipped; which keys hold the arguments is the format's: ``arguments``, and
``parameters`` but in a forced call). A scanner made by `CallScanner.bare_arguments`
reads an arguments object alone, the name having come before it (Mistral v11's
``[TOOL_CALLS]name[ARGS]{...}``).

The scanner follows strings and escapes, so braces inside strings do not count; it
checks the object's shape at its top level (keys, colons, commas) and leaves the
values' own JSON to the parser, which reads the whole text at the end. Cost: one
Python step per character, whatever the pieces the text arrives in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

_Expect = Literal["key", "colon", "value", "scalar", "comma"]


@dataclass
class CallScanner:
    """Where a call's parts are in the held text, once scanned that far (`scan`).

    `start`: where the object begins in the held text; `name`: the function's name once
    its string has ended; `args_start`/`args_end`: the span of the arguments' value
    (`args_end` None while it goes on), `args_kind` its first character (``{`` an
    object, ``"`` a JSON string that should hold one); `end`: where the object ends;
    `failed`: the text is not such an object (nothing more is read).
    """

    start: int
    args_keys: tuple[str, ...] = ("arguments",)
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_kind: str = ""
    end: int | None = None
    failed: bool = False
    bare: bool = False  # only the arguments object: its end is the end
    pos: int = -1  # the next character to read (set from `start`)
    _depth: int = 0  # 1: inside the object, outside its values
    _expect: _Expect = "key"  # at depth 1: what comes next
    _in_string: bool = False
    _escaped: bool = False
    _string_start: int = 0  # where the depth-1 string being read began
    _key: str | None = None  # the key whose value is being read
    _value_start: int = 0

    def __post_init__(self) -> None:
        if self.pos < 0:
            self.pos = self.start

    @classmethod
    def bare_arguments(cls, start: int, name: str) -> CallScanner:
        """A scanner of an arguments object alone, for the call `name`."""
        return cls(start, ("arguments",), name=name, bare=True, _depth=1, _expect="value",
                   _key="arguments")  # fmt: skip

    @property
    def done(self) -> bool:
        return self.failed or self.end is not None

    def scan(self, text: str) -> None:
        """Read `text` (the held text, grown since the last call) up to its end, or to
        the end of the object."""
        i = self.pos
        while i < len(text) and not self.done:
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 1:
                        self._string_ended(text, i + 1)
            elif self._depth == 0:
                if ch == "{":
                    self._depth = 1
                elif not ch.isspace():
                    self.failed = True
            elif self._depth > 1:
                if ch == '"':
                    self._in_string = True
                elif ch in "{[":
                    self._depth += 1
                elif ch in "}]":
                    self._depth -= 1
                    if self._depth == 1:
                        self._value_ended(i + 1)
            else:
                self._top(text, i, ch)
            i += 1
        self.pos = i

    def _top(self, text: str, i: int, ch: str) -> None:
        """One character at the object's top level, outside strings."""
        expect = self._expect
        if expect == "scalar":
            if ch.isspace() or ch in ",}":
                self._value_ended(i)
                expect = self._expect
            else:
                return
        if ch.isspace() or self.done:
            return
        if expect == "key" and ch == '"':
            self._in_string, self._string_start = True, i
        elif expect == "key" and ch == "}" and self._key is None:
            self.end = i + 1  # {}
        elif expect == "colon" and ch == ":":
            self._expect = "value"
        elif expect == "value":
            self._value_began(i, ch)
            if ch == '"':
                self._in_string, self._string_start = True, i
            elif ch in "{[":
                self._depth += 1
            else:
                self._expect = "scalar"
        elif expect == "comma" and ch == ",":
            self._expect = "key"
        elif expect == "comma" and ch == "}":
            self.end = i + 1
        else:
            self.failed = True

    def _string_ended(self, text: str, end: int) -> None:
        if self._expect == "key":
            self._key = _string(text[self._string_start : end])
            self.failed = self._key is None
            self._expect = "colon"
        else:  # a string value
            if self._key == "name" and self.name is None:
                self.name = _string(text[self._string_start : end])
                self.failed = self.name is None
            self._value_ended(end)

    def _value_began(self, i: int, ch: str) -> None:
        self._value_start = i
        if self._key in self.args_keys and self.args_start is None:
            self.args_start, self.args_kind = i, ch

    def _value_ended(self, end: int) -> None:
        self._expect = "comma"
        if self.args_end is None and self.args_start == self._value_start:
            self.args_end = end
        if self.bare:
            self.end = end


def _string(literal: str) -> str | None:
    """A JSON string literal's value (None: an invalid escape)."""
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
