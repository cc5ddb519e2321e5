"""Reasoning in a model's output: the text a thinking model writes before its answer,
split off as ``reasoning_content`` (chat) or a ``reasoning`` item (the Responses API).

Formats (`PARSERS`, chosen by `ReasoningFormat.for_template` or the
``reasoning_parser`` setting):

* ``qwen3`` (Qwen3, QwQ-style templates that leave ``<think>`` to the model): a reply
  that begins with ``<think>`` reasons until ``</think>``; one that does not is all
  answer. When the prompt itself ends in an open ``<think>``, the reply starts inside it.
* ``deepseek_r1`` (DeepSeek-R1 and templates whose generation prompt ends in
  ``<think>``): the reply reasons until ``</think>`` whether or not it repeats
  ``<think>``, unless the prompt closed the block (a template's thinking switch
  writing ``<think></think>``).
* ``gpt_oss`` (OpenAI's harmony format): ``<|channel|>analysis<|message|>...<|end|>``
  is reasoning, the ``final`` (and ``commentary``) channels the answer; the headers
  between are dropped.
* ``none``: nothing is split off.

Newlines at the edges are dropped as the think templates drop them when they render an
earlier turn (``reasoning_content.strip('\\n')``, ``content.lstrip('\\n')``), so a reply
sent back renders as the model wrote it. A reply cut short inside its reasoning (no end
marker: ``max_tokens``) is all reasoning. `ReasoningStream.feed` takes text deltas and
returns ``("reasoning" | "content", text)`` segments as soon as they are certain: a
marker split across deltas is held until it is whole, so a reasoning segment is never
sent as content; the segments of a streamed reply add up to those of the whole reply.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta

from radixserve.errors import InvalidRequestError
from radixserve.model.chat_template import ChatTemplate
from radixserve.model.tokenizer import Tokenizer
from radixserve.services.gateway.server.errors import OpenAIError

Kind = Literal["reasoning", "content"]
Segment = tuple[Kind, str]
#: the ``reasoning_parser`` setting's values (``auto``: from the chat template)
PARSER_NAMES = ("none", "qwen3", "deepseek_r1", "gpt_oss")
SETTING_VALUES = ("auto", *PARSER_NAMES)
#: the Responses API's ``reasoning.effort`` values, and the one that asks for nothing
EFFORTS = ("none", "minimal", "low", "medium", "high")
DEFAULT_EFFORT = "medium"

THINK_START, THINK_END = "<think>", "</think>"
_HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>",
                    "<|return|>", "<|constrain|>")  # fmt: skip
_HARMONY_BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_PROBE = [{"role": "user", "content": "Hi"}]  # renders a template's generation prompt


def partial_marker(buf: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `buf` could begin one of `markers`."""
    return max((n for m in markers for n in range(len(m) - 1, 0, -1) if buf.endswith(m[:n])),
               default=0)  # fmt: skip


class ReasoningStream(abc.ABC):
    """One choice's text split into reasoning and answer (see the module docstring):
    the text not yet certain is held in ``_buf``, which `_step` advances over."""

    _buf: str

    def feed(self, text: str) -> list[Segment]:
        """The segments of `text` that are certain now."""
        self._buf += text
        out: list[Segment] = []
        while self._buf and self._step(out):
            pass
        return out

    @abc.abstractmethod
    def _step(self, out: list[Segment]) -> bool:
        """Advance over the held text, adding to ``out``; False when the rest must wait
        for more."""

    @abc.abstractmethod
    def finish(self) -> list[Segment]:
        """The segments held back once the choice has finished."""


@dataclass
class ThinkStream(ReasoningStream):
    """``<think>...</think>``: `reasoning` says whether the reply starts inside the block.

    States: ``head`` (nothing but whitespace yet: a ``<think>`` may open the block),
    ``reasoning`` (until ``</think>``), ``after`` (newlines after it, dropped), ``content``
    (the rest, sent as it comes)."""

    reasoning: bool = False
    _state: str = "head"
    _started: bool = False  # some reasoning text was sent (its leading newlines dropped)
    _buf: str = ""

    def __post_init__(self) -> None:
        if self.reasoning:
            self._state = "reasoning"

    def _step(self, out: list[Segment]) -> bool:
        buf = self._buf
        if self._state == "head":
            rest = buf.lstrip()
            if rest.startswith(THINK_START):
                self._state, self._buf = "reasoning", rest[len(THINK_START) :]
                return True
            if not rest or THINK_START.startswith(rest):
                return False
            self._state = "content"
        if self._state == "content":
            out.append(("content", buf))
            self._buf = ""
            return False
        if self._state == "after":
            self._buf = buf.lstrip("\n")
            if self._buf:
                self._state = "content"
            return bool(self._buf)
        if not self._started:  # reasoning: its leading newlines (and a repeated <think>) go
            rest = buf.lstrip("\n")
            if rest.startswith(THINK_START):
                self._buf = rest[len(THINK_START) :]
                return True
            if not rest or THINK_START.startswith(rest):
                return False
            self._started, buf = True, rest
        end = buf.find(THINK_END)
        if end >= 0:
            self._emit(out, buf[:end].rstrip("\n"))
            self._state, self._buf = "after", buf[end + len(THINK_END) :]
            return True
        keep = partial_marker(buf, (THINK_END,))
        head = buf[: len(buf) - keep]
        cut = len(head.rstrip("\n"))  # newlines before </think> are dropped: hold them
        self._emit(out, buf[:cut])
        self._buf = buf[cut:]
        return False

    @staticmethod
    def _emit(out: list[Segment], text: str) -> None:
        if text:
            out.append(("reasoning", text))

    def finish(self) -> list[Segment]:
        buf, self._buf = self._buf, ""
        if self._state in ("head", "content"):
            return [("content", buf)] if buf else []
        if self._state == "reasoning":
            text = buf.rstrip("\n") if self._started else buf.strip("\n")
            return [("reasoning", text)] if text else []
        return []


@dataclass
class HarmonyStream(ReasoningStream):
    """The harmony format: a header (``<|channel|>name``, dropped) before each
    ``<|message|>``; the ``analysis`` channel's messages are reasoning, the others the
    answer. A reply that does not begin with a header is all answer."""

    _header: bool = True  # inside a header (the reply starts with one)
    _channel: Kind = "content"
    _seen_header: bool = False  # a header was found (else the reply may be plain text)
    _buf: str = ""

    def _step(self, out: list[Segment]) -> bool:
        buf = self._buf
        if self._header:
            if not self._seen_header and not buf.startswith("<|") and buf != "<":
                self._header = False  # no header: a plain answer
                return True
            i = buf.find("<|message|>")
            if i < 0:
                return False
            self._seen_header = True
            self._channel = "reasoning" if "analysis" in buf[:i] else "content"
            self._header, self._buf = False, buf[i + len("<|message|>") :]
            return True
        ends = [j for j in (buf.find(m) for m in _HARMONY_BODY_ENDS) if j >= 0]
        if ends:
            j = min(ends)
            if j:
                out.append((self._channel, buf[:j]))
            marker = next(m for m in _HARMONY_BODY_ENDS if buf.startswith(m, j))
            self._header, self._buf = True, buf[j + len(marker) :]
            self._seen_header = True
            return True
        cut = len(buf) - partial_marker(buf, _HARMONY_BODY_ENDS)
        if cut:
            out.append((self._channel, buf[:cut]))
        self._buf = buf[cut:]
        return False

    def finish(self) -> list[Segment]:
        buf, self._buf = self._buf, ""
        if self._header:  # an unfinished header is dropped
            return [] if self._seen_header or not buf else [("content", buf)]
        return [(self._channel, buf)] if buf else []


@dataclass(frozen=True)
class ReasoningParser:
    """A format: how its stream starts (`always_opens`: a reply reasons from its start
    unless the prompt closed the block), the marker tokens a decode must keep, and the
    text that opens and closes a reasoning segment (`start`, `end`: what a thinking-token
    budget counts between, and the end it forces)."""

    name: str
    always_opens: bool = False
    tokens: tuple[str, ...] = ()
    start: str = THINK_START
    end: str = THINK_END

    def opens(self, prompt_opens: bool | None) -> bool:
        """Whether a reply starts inside its reasoning; `prompt_opens`: the prompt ends
        inside an open think block (True), after a closed one (False), or neither (None)."""
        if self.name == "gpt_oss":
            return False  # a reply opens its analysis channel itself
        return prompt_opens is True or (self.always_opens and prompt_opens is None)

    def stream(self, prompt_opens: bool | None) -> ReasoningStream:
        """A choice's splitter (`prompt_opens` as for `opens`)."""
        if self.name == "gpt_oss":
            return HarmonyStream()
        return ThinkStream(reasoning=self.opens(prompt_opens))


PARSERS = {
    "qwen3": ReasoningParser("qwen3", tokens=(THINK_START, THINK_END)),
    "deepseek_r1": ReasoningParser("deepseek_r1", always_opens=True,
                                   tokens=(THINK_START, THINK_END)),
    "gpt_oss": ReasoningParser("gpt_oss", tokens=_HARMONY_MARKERS,
                               start="<|channel|>analysis<|message|>", end="<|end|>"),
}  # fmt: skip


def prompt_opens(tail: str) -> bool | None:
    """Whether a prompt's last characters leave a think block open (True), closed
    (False), or hold no marker (None)."""
    start, end = tail.rfind(THINK_START), tail.rfind(THINK_END)
    if start < 0 and end < 0:
        return None
    return start > end


def parser_for_template(source: str | None) -> str:
    """The parser a chat template's own format calls for (``none`` when it shows no
    reasoning markers)."""
    text = source or ""
    if "<|channel|>" in text and "analysis" in text:
        return "gpt_oss"
    if THINK_START not in text and THINK_END not in text:
        return "none"
    try:  # a generation prompt that opens the block: the DeepSeek-R1 convention
        prompt = ChatTemplate(text).render(_PROBE, add_generation_prompt=True)
    except InvalidRequestError:  # a template that needs more than one user message
        prompt = ""
    return "deepseek_r1" if prompt.rstrip().endswith(THINK_START) else "qwen3"


def template_variables(source: str | None) -> set[str]:
    """The Jinja variables a chat template reads (none if it does not parse)."""
    if not source:
        return set()
    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
    try:
        return set(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateError:
        return set()


@dataclass(frozen=True)
class ReasoningPlan:
    """What a chat job's choices need: the parser and where the prompt left them."""

    parser: str
    prompt_opens: bool | None

    def stream(self) -> ReasoningStream:
        return PARSERS[self.parser].stream(self.prompt_opens)

    def budget_fields(self, tokenizer: Tokenizer, budget: int) -> dict[str, Any]:
        """The `SamplingParams` fields that cap a reply's reasoning at `budget` tokens:
        the format's start and end markers as token ids, and whether the reply starts
        inside its reasoning (`radixserve.engine.thinking_budget`)."""
        parser = PARSERS[self.parser]
        return {
            "thinking_token_budget": budget,
            "thinking_start_ids": tuple(tokenizer.encode(parser.start, add_special_tokens=False)),
            "thinking_end_ids": tuple(tokenizer.encode(parser.end, add_special_tokens=False)),
            "thinking_open": parser.opens(self.prompt_opens),
        }


@dataclass(frozen=True)
class ReasoningFormat:
    """How this model's replies carry reasoning (decided once, from its chat template)
    and the template's thinking switch: ``enable_thinking`` (Qwen3's), ``thinking``
    (DeepSeek V3.1's), ``reasoning_effort`` (gpt-oss's), or None."""

    parser: str  # a key of `PARSERS`, or "none"
    switch: str | None = None

    @classmethod
    def for_template(cls, source: str | None, setting: str = "auto") -> ReasoningFormat:
        parser = parser_for_template(source) if setting == "auto" else setting
        variables = template_variables(source)
        switch = next((name for name in ("enable_thinking", "thinking", "reasoning_effort")
                       if name in variables), None)  # fmt: skip
        return cls(parser, switch)

    def kept_token_ids(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        """The parser's marker tokens that this vocabulary makes special (a decode
        leaves them out unless told to keep them: gpt-oss's headers)."""
        if self.parser not in PARSERS:
            return ()
        ids = (tokenizer.token_to_id(token) for token in PARSERS[self.parser].tokens)
        return tuple(i for i in ids if i is not None and not tokenizer.decode([i]))

    def plan(self, prompt_tail: str) -> ReasoningPlan | None:
        """The plan of a job whose prompt ends in `prompt_tail` (None: no parser)."""
        if self.parser not in PARSERS:
            return None
        return ReasoningPlan(self.parser, prompt_opens(prompt_tail))

    def effort_variables(self, effort: str | None, param: str) -> dict[str, object]:
        """The template variables that carry a requested reasoning effort: the
        switch off for none/minimal and on otherwise (gpt-oss: the level itself); with
        no switch, only the default effort is accepted (400 naming `param`)."""
        if effort is None:
            return {}
        if effort not in EFFORTS:
            raise OpenAIError(400, f"{param} must be one of {', '.join(EFFORTS)}, got "
                              f"{effort!r}", param)  # fmt: skip
        if self.switch == "reasoning_effort":
            if effort in ("none", "minimal"):
                raise OpenAIError(400, f"{param} {effort!r} is not served: this model always "
                                  "reasons (its template takes low, medium or high)", param)  # fmt: skip
            return {"reasoning_effort": effort}
        if self.switch is not None:
            return {self.switch: effort not in ("none", "minimal")}
        if effort != DEFAULT_EFFORT:
            raise OpenAIError(400, f"{param} {effort!r} is not served: this model's chat "
                              "template has no thinking switch (enable_thinking), so only "
                              f"{DEFAULT_EFFORT!r} (its own behaviour) is accepted; leave it "
                              "out", param)  # fmt: skip
        return {}


def split_reasoning(stream: ReasoningStream, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole reply, as its streamed segments add up."""
    parts: dict[Kind, list[str]] = {"reasoning": [], "content": []}
    for kind, piece in stream.feed(text) + stream.finish():
        parts[kind].append(piece)
    return "".join(parts["reasoning"]), "".join(parts["content"])
