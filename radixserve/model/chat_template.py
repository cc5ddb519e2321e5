"""Rendering Jinja chat templates the way Hugging Face transformers does.

A template is compiled once by `ChatTemplate` in a sandboxed Jinja environment with the
same options and helpers transformers gives it (`trim_blocks`, `lstrip_blocks`, the
`loopcontrols` extension, `raise_exception`, `strftime_now` and a non-escaping `tojson`),
so a conversation renders to the same prompt text as
`tokenizer.apply_chat_template(messages, tokenize=False)`.

Messages are validated first: a list of dicts, each with a string `role` and a `content`
that is a string or a list of `{"type": "text", "text": str}` parts (joined with "\\n"
into one string, since most templates concatenate `content`). Keys whose value is None
are dropped, as transformers does. Anything malformed, and any error the template
raises while rendering, becomes an `InvalidRequestError`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from radixserve.errors import InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _content_text(content: Any, index: int) -> str:
    """A message's content as one string; raises InvalidRequestError when malformed."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise InvalidRequestError(
                    f"messages[{index}].content parts must be {{'type': 'text', 'text': str}}, "
                    f"got {part!r}"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError(
        f"messages[{index}].content must be a string or a list of text parts, "
        f"got {type(content).__name__}"
    )


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checked copies of `messages`, ready for a template.

    Contract: returns a new list of new dicts (the caller's are never modified) in which
    every `role` is a str and every `content` is a str; None-valued keys are dropped.
    Raises InvalidRequestError for anything else, including an empty list.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise InvalidRequestError(
            f"messages must be a list of dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise InvalidRequestError("messages must not be empty")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}].role must be a non-empty string")
        if message.get("content") is None:
            raise InvalidRequestError(f"messages[{i}].content is missing")
        clean = {k: v for k, v in message.items() if v is not None}
        clean["content"] = _content_text(message["content"], i)
        checked.append(clean)
    return checked


class ChatTemplate:
    """A compiled chat template.

    Construction compiles the source once and raises ModelLoadError when it is not valid
    Jinja (a fault of the model files, not of a request). `render` is safe to call from
    several threads: the compiled template is immutable.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ModelLoadError(f"chat template does not compile: {exc}") from exc

    def render(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        bos_token: str | None = None,
        eos_token: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`.

        Variables the template sees: `messages` (validated, see `validate_messages`),
        `add_generation_prompt`, `bos_token`, `eos_token` (empty strings when None) and
        every extra keyword argument (e.g. `tools`, `date_string`). Raises
        InvalidRequestError for bad messages and for any template error, including one
        the template raises itself through `raise_exception`.
        """
        checked = validate_messages(messages)
        variables = {"bos_token": bos_token or "", "eos_token": eos_token or "", **kwargs}
        try:
            return self._template.render(
                messages=checked, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template error: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise InvalidRequestError(f"chat template failed on these messages: {exc}") from exc

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars)"
