"""Incremental detokenisation with stop strings, for streaming generated text.

Two layers. `_TokenTextStream` turns token ids into text one token at a time by decoding a
short sliding window of recent tokens and emitting what the window's text gained, holding
back trailing U+FFFD characters (a multi-byte character whose remaining bytes are still to
come in later tokens). `IncrementalDetokenizer` adds stop strings on top: it truncates the
text right before the first stop string and holds back any tail that could still grow into
one, so a streaming client never sees a stop string or a piece of one.

Special tokens are left out of the text, except the few a request asks to keep (a
tool-call parser's markers, e.g. ``<|python_tag|>``): those are spelled out where they
occur, the text between them decoded as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_SLIDE_AT = 8  # window length (tokens) at which the window is cut back to `_KEEP` tokens
_KEEP = 4  # tokens of decoding context kept after a cut (covers a 4-byte character)
_MAX_WINDOW = 32  # past this, trailing U+FFFD is taken as invalid bytes and emitted as is


class TokenDecoder(Protocol):
    """The tokenizer surface the detokenizer needs."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; undecodable bytes become U+FFFD."""
        ...


def _keeping(tokenizer: TokenDecoder, kept: frozenset[int]) -> Callable[[Sequence[int]], str]:
    """A decode that skips special tokens but spells out those in `kept`."""
    if not kept:
        return tokenizer.decode

    def decode(ids: Sequence[int]) -> str:
        if kept.isdisjoint(ids):
            return tokenizer.decode(ids)
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in kept:
                parts += [tokenizer.decode(run), tokenizer.decode([token_id], False)]
                run = []
            else:
                run.append(token_id)
        parts.append(tokenizer.decode(run))
        return "".join(parts)

    return decode


def _trailing_replacements(text: str) -> int:
    """Number of U+FFFD characters at the end of `text`."""
    return len(text) - len(text.rstrip(_REPLACEMENT))


class _TokenTextStream:
    """Token ids in, stable text pieces out; decodes at most ~`_MAX_WINDOW` tokens a step.

    Invariant: the first `_emitted` characters of `decode(_ids)` have been returned, and
    decoding `_ids + later` extends that text the same way decoding the whole sequence would.
    """

    def __init__(self, tokenizer: TokenDecoder, kept: frozenset[int] = frozenset()) -> None:
        self._decode = _keeping(tokenizer, kept)  # special tokens skipped but the kept
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        held = _trailing_replacements(text)
        if len(self._ids) > _MAX_WINDOW:
            held = 0  # no character needs this many tokens: these are invalid bytes
        end = len(text) - held
        piece = text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        if len(self._ids) > _SLIDE_AT:
            self._slide(text)
        return piece

    def finish(self) -> str:
        """Return whatever is held back (trailing U+FFFD of an unfinished character)."""
        text = self._decode(self._ids)
        piece = text[self._emitted :]
        self._emitted = max(self._emitted, len(text))
        return piece

    def _slide(self, text: str) -> None:
        """Cut the window to its last `_KEEP` tokens when that provably decodes the same tail.

        The cut may land inside a character, which only garbles the start of the new
        window's text. It is safe once a real (non-U+FFFD) character precedes the part not
        yet emitted in both decodings: UTF-8 decoding has resynchronised by then, so both
        windows extend identically from there on.
        """
        pending = max(0, len(text) - self._emitted)
        new_ids = self._ids[-_KEEP:]
        new_text = self._decode(new_ids)
        forced = len(self._ids) > _MAX_WINDOW  # pending is 0 here: everything was emitted
        if not forced:
            if len(new_text) <= pending or len(text) <= pending:
                return
            anchor = new_text[len(new_text) - pending - 1 :]
            if anchor[0] == _REPLACEMENT or not text.endswith(anchor):
                return
        self._ids = new_ids
        self._emitted = max(0, len(new_text) - pending)


def _find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The stop string that completes first in `text` and where it starts, or None.

    "First" is by end position (ties: the longer one), which is what a character-by-
    character stream would see, so the result does not depend on how text was tokenised.
    """
    hits = [(start + len(stop), start, stop) for stop in stops if (start := text.find(stop)) >= 0]
    if not hits:
        return None
    _, start, stop = min(hits, key=lambda hit: hit[:2])  # (end, start): the first of equals
    return start, stop


def _partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    if not text:
        return 0
    best = 0
    last = text[-1]
    for stop in stops:
        # A candidate prefix stop[:k] must end with `last`: try those k, longest first.
        j = stop.rfind(last, 0, min(len(stop) - 1, len(text)))
        while j + 1 > best:
            if text.endswith(stop[: j + 1]):
                best = j + 1
                break
            j = stop.rfind(last, 0, j)
    return best


class IncrementalDetokenizer:
    """Streams one request's generated text, stopping at stop strings.

    `add(token_id)` returns the text that is now safe to show. Without a stop match,
    the deltas of every `add` plus `flush()` concatenate to `tokenizer.decode(ids)`.
    When a stop string appears in the generated text, even across token boundaries,
    `stopped` becomes True, `stop_reason` is that string, and `text` ends right before
    it; later `add` calls return "". With several stop strings, the one completing
    first wins. Each `add` decodes a window of at most ~`_MAX_WINDOW` (usually <= 8) tokens.
    """

    def __init__(
        self, tokenizer: TokenDecoder, stop: Sequence[str] = (), kept: Sequence[int] = ()
    ) -> None:
        """``stop``: non-empty strings (`SamplingParams` checks them); ``kept``: special
        token ids whose text is kept."""
        self._stops = tuple(stop)
        self._stream = _TokenTextStream(tokenizer, frozenset(kept))
        self._held = ""  # decoded text that may be the start of a stop string
        self._parts: list[str] = []
        self._text = ""
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far (deltas joined); excludes held-back text."""
        if self._parts:
            self._text += "".join(self._parts)
            self._parts.clear()
        return self._text

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the newly safe-to-emit text (maybe "")."""
        if self.stopped:
            return ""
        return self._emit(self._stream.push(token_id), final=False)

    def flush(self) -> str:
        """At the end of generation: emit all held-back text, unless a stop string matched.

        Held-back text is still checked for stop strings (an unfinished character may
        complete one). Call once, after the last `add`.
        """
        if self.stopped:
            return ""
        return self._emit(self._stream.finish(), final=True)

    def _emit(self, piece: str, final: bool) -> str:
        if not piece and not (final and self._held):
            return ""
        buffer = self._held + piece
        hit = _find_stop(buffer, self._stops) if self._stops else None
        if hit is not None:
            start, stop = hit
            out = buffer[:start]
            self._held = ""
            self.stopped = True
            self.stop_reason = stop
        else:
            keep = 0 if final else _partial_stop_len(buffer, self._stops)
            out = buffer[: len(buffer) - keep]
            self._held = buffer[len(buffer) - keep :]
        if out:
            self._parts.append(out)
        return out
