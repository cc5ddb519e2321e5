"""A stream resumed after k tokens (a request migrated off a lost worker:
`Engine.admit(resume=)`) continues exactly as the uninterrupted one would have: the same
tokens, and text that picks up where the first stream's text left off — for greedy,
for seeded sampling with penalties, and across a stop string whose start was held back
when the first stream was cut."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import InvalidRequestError
from radixserve.protocol.cached_tokens import CachedTokens
from tests.engine.engine_helpers import assert_no_leaks

_ids = itertools.count()
PROMPT = "Write three short sentences about rivers and the sea."


@dataclass
class Stream:
    tokens: list[int]
    texts: list[str]  # one per output, in order
    counts: list[int]  # tokens per output
    finish_reason: str | None
    completion_tokens: int
    prompt_tokens: int
    cached: CachedTokens  # the prompt's hits, from the last output

    def text_after(self, k: int) -> str:
        """The text streamed once the first ``k`` tokens were out (one token a step)."""
        seen, out = 0, []
        for piece, n in zip(self.texts, self.counts):
            if seen + n > k:
                break
            seen += n
            out.append(piece)
        return "".join(out)


def run(engine, params: SamplingParams, resume: list[int] | None = None) -> Stream:
    rid = f"resume-{next(_ids)}"
    engine.admit(engine.tokenizer.encode(PROMPT), params, rid, resume=resume or ())
    tokens: list[int] = []
    texts: list[str] = []
    counts: list[int] = []
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                texts.append(out.new_text)
                counts.append(len(out.new_token_ids))
                last = out
    assert last is not None and last.finished
    return Stream(tokens, texts, counts, last.finish_reason, last.completion_tokens,
                  last.prompt_tokens, last.cached)  # fmt: skip


def assert_continues(engine, params: SamplingParams, full: Stream, k: int) -> None:
    rest = run(engine, params, full.tokens[:k])
    assert full.tokens[:k] + rest.tokens == full.tokens, k
    assert full.text_after(k) + "".join(rest.texts) == "".join(full.texts), k
    assert (rest.finish_reason, rest.completion_tokens) == (
        full.finish_reason,
        full.completion_tokens,
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, min_tokens=20, temperature=0.0),
        SamplingParams(
            max_tokens=20,
            min_tokens=20,
            temperature=0.9,
            top_p=0.9,
            seed=7,
            frequency_penalty=0.6,
            presence_penalty=0.4,
        ),
    ],
    ids=["greedy", "seeded-penalties"],
)
def test_a_resumed_stream_continues_exactly(tiny_on, params):
    full = run(tiny_on, params)
    assert len(full.tokens) == 20
    for k in (1, 9, 19):
        assert_continues(tiny_on, params, full, k)
    assert_no_leaks(tiny_on)


def test_a_resumed_stream_reports_its_own_hits_within_its_prompt(tiny_on):
    """The engine holds the prompt and the first stream's tokens now: the resumed stream
    matches past its prompt, yet reports only prompt tokens as cached, all from the device."""
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0.0)
    full = run(tiny_on, params)
    assert full.prompt_tokens < tiny_on.page_size and full.cached == CachedTokens()
    rest = run(tiny_on, params, full.tokens[:30])  # matches 2 pages: prompt and 22 tokens
    assert rest.cached == CachedTokens(device=rest.prompt_tokens)
    assert_no_leaks(tiny_on)


def test_a_stop_string_held_back_at_the_cut_still_stops_the_resumed_stream(tiny_on):
    plain = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0)
    pieces = run(tiny_on, plain).texts  # one token each
    text = "".join(pieces)
    # a stop string across two tokens: when the first stream is cut after the first of
    # them, the start of the stop string is held back, unsent; the resumed stream must
    # still stop on it (and emit nothing of it)
    for j in range(len(pieces) // 2, len(pieces) - 1):
        a, b = pieces[j], pieces[j + 1]
        stop = a[-2:] + b[:2]
        at = len("".join(pieces[:j])) + len(a) - len(a[-2:])
        if len(a) >= 2 and len(b) >= 2 and stop.strip() and text.find(stop) == at:
            break
    else:
        pytest.fail(f"no stop string across two tokens in {text!r}")
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, stop=[stop])
    full = run(tiny_on, params)
    assert full.finish_reason == "stop" and "".join(full.texts) == text[:at]
    assert len(full.text_after(j + 1)) < at + 2  # the cut after token j holds back
    for k in sorted({1, j + 1, len(full.tokens) - 1}):  # j + 1: the cut inside the stop
        assert_continues(tiny_on, params, full, k)
    assert_no_leaks(tiny_on)


def test_what_cannot_resume_is_refused_and_leaves_nothing(tiny_on):
    ids = tiny_on.tokenizer.encode(PROMPT)
    vocab = tiny_on.config.vocab_size
    for params, resume in [
        (SamplingParams(max_tokens=8, n=2, temperature=0.5, seed=1), [5]),
        (SamplingParams(max_tokens=8), [vocab]),
        (SamplingParams(max_tokens=2), [5, 6]),  # nothing left to generate
    ]:
        with pytest.raises(InvalidRequestError):
            tiny_on.admit(ids, params, f"bad-{next(_ids)}", resume=resume)
    assert_no_leaks(tiny_on)
