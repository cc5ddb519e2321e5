"""Speculative decoding without a draft model: drafts from the request's own tokens
(prompt lookup) and from the token sequences this engine has cached (the draft index),
verified in the step that decodes them.

Drafting. Before a step, each decoding request that may speculate (`Speculator.propose`)
gets up to k draft tokens (`Request.draft`):

* ``prompt``: the latest earlier place in its own tokens (prompt and output) where its
  last n tokens occur (n from `MAX_NGRAM` down to `MIN_NGRAM`, the longest match
  first), and the tokens that followed it there;
* ``radix``: the `DraftIndex` — the token sequences the engine's cache was given
  (every request's tokens, prompt and output, when it ends), kept per cache namespace,
  so a draft never crosses a tenant's (or a model's) isolation boundary; a draft is the
  most frequent continuation, token by token, of the longest n-gram seen (up to
  `INDEX_MAX_NGRAM` tokens), each token with its evidence (that n, and whether the
  texts agreed);
* ``both``: prompt lookup first, the index where it finds nothing.

k adapts per request and per step (`Speculator`): a draft token is worth the chance it
is kept (the request's own record for prompt lookup, its evidence's for the index) and
costs a row of the step (the engine's measured step times by rows, `StepCost`); a step
verifies the draft tokens that give it the most expected tokens per second, so
speculation backs off by itself in big batches (a row's share of the step nears 1) and
for requests whose drafts miss. It stands down altogether for a step with more than
``max_batch`` decoding requests, and for requests whose tokens a grammar guides (its
masks are made for one position a step).

Verification (`Engine.step`) is exact. The request's next chunk is its pending token
followed by its draft; the model returns the logits of every position of it. Position i
is then sampled exactly as a plain decode step would sample it — the same sampler, the
same penalties, stop checks, log-probabilities and thinking budget, the same seeded
generator (a function of the tokens sampled so far: `sampler.step_generator`), given the
same tokens before it — and draft token i + 1 is kept only if it is the token sampled
there. The first mismatch ends the step: the sampled token is appended, like the
correction of ordinary speculative decoding. So the tokens appended are exactly those
decoding one by one would give: greedy, seeded or not (an unseeded draw is a fresh draw
from the same distribution). The kernels are batch-invariant, so a position's logits
have the same bits in a verification chunk as in a decode step.

KV of rejected draft tokens: their slots lie past the request's computed tokens and are
written again by the tokens that come later; the pages stay the request's (they are its
next pages) and return with it. Only accepted positions count as computed, so the cache
is given no rejected token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from radixserve.engine.choice_sampler import Draw
from radixserve.engine.draft_index import EVIDENCE_CLASSES, MIN_NGRAM, DraftIndex
from radixserve.engine.outputs import TokenLogprob
from radixserve.engine.request import Request, RequestStatus

SpeculativeMethod = Literal["off", "prompt", "radix", "both"]
METHODS: tuple[SpeculativeMethod, ...] = ("off", "prompt", "radix", "both")
#: the longest n-gram prompt lookup matches (down to `MIN_NGRAM`), the longest first
MAX_NGRAM = 4


class NgramPlaces:
    """Where each n-gram (`MIN_NGRAM`..`MAX_NGRAM` tokens) of a growing token list last
    occurred with a token after it: n-gram -> the index of that token. `extend` indexes
    what was appended since it last ran."""

    def __init__(self) -> None:
        self.places: dict[tuple[int, ...], int] = {}
        self.upto = 0  # positions indexed: every n-gram ending before it

    def extend(self, tokens: Sequence[int]) -> None:
        for end in range(max(self.upto, MIN_NGRAM), len(tokens)):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                self.places[tuple(tokens[end - n : end])] = end
        self.upto = max(self.upto, len(tokens))

    def find(self, tokens: Sequence[int]) -> int | None:
        """Where the tokens that followed ``tokens``' last n tokens start (the longest n
        indexed), or None."""
        for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
            end = self.places.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return end
        return None


def prompt_lookup(tokens: Sequence[int], k: int, places: NgramPlaces | None = None) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``tokens``' last
    n tokens in ``tokens`` (the longest n that occurs); [] if none does. ``places``: the
    request's index, brought up to date here (a fresh one if None)."""
    places = places if places is not None else NgramPlaces()
    places.extend(tokens)
    end = places.find(tokens)
    return [] if end is None else list(tokens[end : end + k])


@dataclass
class MethodStats:
    """Counters of one drafting method (the metrics' source: acceptance is accepted /
    drafted, tokens per verification emitted / steps)."""

    steps: int = 0  # verification chunks run
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them kept
    emitted: int = 0  # tokens appended by those chunks (accepted + the sampled one)


class StepCost:
    """What a step of a given number of rows (new tokens) takes: the recent mean of the
    steps of that many rows where they ran lately (each weighs `ROW_DECAY` times the
    next; a row count not run in the last `FRESH_STEPS` steps is forgotten, so a slow
    outlier that keeps drafts of that size away cannot keep them away for good), and
    otherwise a line ``a + b`` x rows fitted by least squares over recent steps (each
    weighs `DECAY` times the next; until the rows vary enough to fit a slope, half of a
    step's time is taken to be per row). Made non-decreasing in rows. The line alone is
    wrong where it matters: on a CPU a second row costs next to nothing (the weights are
    read once for both) and each row past three or so a sixth of a step (the step turns
    compute-bound), so a draft's first token is nearly free and its eighth is not."""

    DECAY = 0.97
    ROW_DECAY = 0.8
    FRESH_STEPS = 256

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._steps = 0
        # rows -> (recent mean seconds of such steps, the step that last ran so many)
        self._rows: dict[int, tuple[float, int]] = {}

    def observe(self, rows: int, seconds: float) -> None:
        d = self.DECAY
        self._n, self._x, self._y = d * self._n + 1, d * self._x + rows, d * self._y + seconds
        self._xx, self._xy = d * self._xx + rows * rows, d * self._xy + rows * seconds
        self._steps += 1
        known = self._rows.get(rows)
        if known is not None and self._steps - known[1] < self.FRESH_STEPS:
            seconds = self.ROW_DECAY * known[0] + (1 - self.ROW_DECAY) * seconds
        self._rows[rows] = (seconds, self._steps)

    def _line(self) -> tuple[float, float]:
        mx, my = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mx * mx
        b = (self._xy / self._n - mx * my) / var if var > 0.25 else 0.5 * my / max(mx, 1.0)
        b = min(max(b, 0.0), my / max(mx, 1.0))  # a slope past the mean cost per row is noise
        return max(my - b * mx, 0.0), b

    def seconds(self, most: int) -> list[float] | None:
        """The expected seconds of a step of 1..``most`` rows (index ``rows - 1``); None
        before a step was timed (then nothing is drafted)."""
        if self._n < 1:
            return None
        a, b = self._line()
        times, slowest = [], 0.0
        for rows in range(1, most + 1):
            known = self._rows.get(rows)
            fresh = known is not None and self._steps - known[1] < self.FRESH_STEPS
            slowest = max(slowest, known[0] if fresh else a + b * rows)  # type: ignore[index]
            times.append(slowest)
        return times


class Speculator:
    """Proposes drafts before a step and learns from their verification (module notes).

    How many tokens to draft: a draft token is worth the chance that it and every draft
    token before it are kept, and it costs a row. A prompt-lookup draft's token j is kept
    with probability p^j (p: the share of the request's draft tokens kept so far, per
    position tried; a new request starts from prompt lookup's record). A draft-index
    token's chance is its evidence's record (`evidence_class`: how long a context it
    continues and whether that context always went on so): a token that follows six
    tokens every earlier text followed the same way is kept far more often than one
    after two tokens the texts continued differently, so the index's drafts run long
    where the texts agree and stop where they part. A step of B decoding requests yields
    B tokens plus the worth of the draft tokens it verifies, in the time `StepCost`
    expects of its rows; the draft tokens are taken in order of worth, as many as make
    the most tokens per second (`draft_lengths`): none when no draft token pays for its
    row (a big batch, a request whose drafts miss)."""

    PRIOR_KEPT, PRIOR_TRIED = 1.6, 2.0  # p = 0.8 until its drafts say otherwise
    DECAY = 0.8  # of a request's kept/tried counts per verification
    #: an evidence class's chance starts at 0.8 over 2 tries (as a request's); each try
    #: weighs `EVIDENCE_DECAY` times the next (the record follows the workload)
    PRIOR_EVIDENCE, EVIDENCE_DECAY = (1.6, 2.0), 0.99

    def __init__(self, method: SpeculativeMethod, max_draft_tokens: int, max_batch: int) -> None:
        self.method = method
        self.max_draft_tokens = max_draft_tokens
        self.max_batch = max_batch
        self.index = DraftIndex()
        self.cost = StepCost()
        self.stats = {m: MethodStats() for m in ("prompt", "radix")}
        self._kept: dict[str, tuple[float, float]] = {}  # request id -> (kept, tried)
        self._places: dict[str, NgramPlaces] = {}  # request id -> its own tokens' n-grams
        #: evidence class -> (kept, tried) of the draft-index tokens verified
        self._evidence = [self.PRIOR_EVIDENCE] * EVIDENCE_CLASSES
        self._draft_evidence: dict[str, list[int]] = {}  # request id -> its draft's classes

    @property
    def enabled(self) -> bool:
        return self.method != "off" and self.max_draft_tokens > 0

    def kept_share(self, request_id: str, method: str) -> float:
        """p: the share of a request's draft tokens kept per position tried. A request
        with no record yet starts from its drafting method's, over `PRIOR_TRIED`
        positions."""
        record = self._kept.get(request_id)
        if record is None:
            st = self.stats[method]
            record = (self.PRIOR_TRIED * (st.accepted + self.PRIOR_KEPT)
                      / (st.drafted + self.PRIOR_TRIED), self.PRIOR_TRIED)  # fmt: skip
        return min(1.0, max(0.0, record[0] / record[1]))

    def worth(self, request_id: str, method: str, size: int,
              evidence: Sequence[int] = ()) -> list[float]:  # fmt: skip
        """What each of a draft's ``size`` tokens is worth: the chance that it and every
        token before it are kept (class notes); ``evidence``: a draft-index draft's
        classes."""
        if method == "radix":
            worth, chance = [], 1.0
            for c in evidence:
                kept, tried = self._evidence[c]
                chance *= kept / tried
                worth.append(chance)
            return worth
        p = self.kept_share(request_id, method)
        return [p**j for j in range(1, size + 1)]

    def draft_lengths(self, worths: Sequence[Sequence[float]], rows: int) -> list[int]:
        """How many tokens of each draft (each token's worth, `worth`) a step of ``rows``
        decoding requests verifies (class notes): the draft tokens in order of worth, as
        many as give the step the most expected tokens per second."""
        if not worths:
            return []
        ranked = sorted(((w, i) for i, draft in enumerate(worths) for w in draft),
                        key=lambda w: -w[0])  # fmt: skip
        times = self.cost.seconds(rows + len(ranked))
        lengths = [0] * len(worths)
        if times is None:
            return lengths
        expected, taken = float(rows), 0
        best = expected / times[rows - 1] if times[rows - 1] > 0 else math.inf
        for n, (q, _) in enumerate(ranked, 1):
            expected += q
            rate = expected / times[rows + n - 1] if times[rows + n - 1] > 0 else math.inf
            if rate > best:
                best, taken = rate, n
        for _, i in ranked[:taken]:
            lengths[i] += 1
        return lengths

    def propose(self, running: Sequence[Request], max_model_len: int) -> None:
        """Set `Request.draft` of the decoding requests that speculate this step."""
        decoding = [r for r in running if r.num_pending == 1]
        for req in running:
            req.draft = []
        if not self.enabled or len(decoding) > self.max_batch:
            return
        drafted: list[tuple[Request, list[int], str, list[int]]] = []
        for req in decoding:
            if req.guide is not None:
                continue
            room = min(
                req.params.max_tokens - len(req.output_ids) - 1,  # the sampled one is extra
                max_model_len - req.num_tokens - 1,
            )
            k = min(self.max_draft_tokens, room)
            if k <= 0:
                continue
            tokens = req.token_ids
            draft, method, evidence = list[int](), "", list[int]()
            if self.method in ("prompt", "both"):
                places = self._places.setdefault(req.request_id, NgramPlaces())
                draft, method = prompt_lookup(tokens, k, places), "prompt"
            if not draft and self.method in ("radix", "both"):
                (draft, evidence), method = self.index.lookup(req.namespace, tokens, k), "radix"
            if draft:
                drafted.append((req, draft, method, evidence))
        lengths = self.draft_lengths(
            [self.worth(r.request_id, m, len(d), e) for r, d, m, e in drafted], len(decoding)
        )
        for (req, draft, method, evidence), k in zip(drafted, lengths):
            req.draft = draft[:k]
            req.draft_method = method
            if method == "radix":
                self._draft_evidence[req.request_id] = evidence[:k]

    def verified(self, req: Request, drafted: int, accepted: int, emitted: int) -> None:
        """``req``'s chunk kept ``accepted`` of its ``drafted`` draft tokens."""
        stats = self.stats[req.draft_method]
        stats.steps += 1
        stats.drafted += drafted
        stats.accepted += accepted
        stats.emitted += emitted
        kept, tried = self._kept.get(req.request_id, (self.PRIOR_KEPT, self.PRIOR_TRIED))
        positions = accepted + (accepted < drafted)  # the first miss was tried too
        if req.draft_method == "radix":
            d = self.EVIDENCE_DECAY
            for j, c in enumerate(self._draft_evidence.pop(req.request_id, [])[:positions]):
                c_kept, c_tried = self._evidence[c]
                self._evidence[c] = (d * c_kept + (j < accepted), d * c_tried + 1)
        self._kept[req.request_id] = (self.DECAY * kept + accepted,
                                      self.DECAY * tried + positions)  # fmt: skip

    def counters(self) -> dict[str, int]:
        """The methods' counters, named as the worker's stats carry them."""
        return {f"speculative_{m}_{what}_total": getattr(st, what)
                for m, st in self.stats.items()
                for what in ("steps", "drafted", "accepted", "emitted")}  # fmt: skip

    def reset_index(self) -> None:
        """Empty the draft index (what a benchmark's run drafts from is then its own)."""
        self.index = DraftIndex(self.index.max_tokens)

    def forget(self, req: Request) -> None:
        """``req`` was aborted: drop what was kept for it."""
        self._kept.pop(req.request_id, None)
        self._places.pop(req.request_id, None)
        self._draft_evidence.pop(req.request_id, None)

    def finished(self, req: Request) -> None:
        """``req`` ended: its tokens go into the draft index (when drafting from it)."""
        self.forget(req)
        if self.method in ("radix", "both"):
            self.index.add(req.namespace, req.token_ids)


@dataclass
class Verified:
    """What one request's verification chunk appended."""

    req: Request
    tokens: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    drafted: int
    accepted: int


def verify_drafts(
    first: Sequence[Draw],
    draft_logits: dict[str, torch.Tensor],
    last_rows: dict[str, torch.Tensor],
    sample: Callable[[torch.Tensor, list[Request]], list[Draw]],
    add: Callable[[Request, int, TokenLogprob | None], str],
) -> list[Verified]:
    """Verify the drafts of the requests drawn in ``first`` (their first position's
    token, sampled from their first draft row); ``draft_logits``: each one's rows for its
    chunk's first k positions, ``last_rows``: its last position's row. ``sample(rows,
    reqs)`` samples as a plain step would, ``add(req, token, logprob)`` appends a token
    (stop checks, finishing) and gives its text. Position i + 1 is sampled only if
    position i's token is the draft's (module notes); each accepted draft token's KV is
    counted as computed."""
    state = {
        req.request_id: Verified(
            req, [tok], add(req, tok, lp), None if lp is None else [lp], len(req.draft), 0
        )  # fmt: skip
        for req, tok, lp in first
    }
    step = 0
    while True:
        going = [
            v.req
            for v in state.values()
            if v.req.status is RequestStatus.RUNNING
            and v.accepted == step  # every draft token so far kept
            and step < v.drafted
            and v.tokens[-1] == v.req.draft[step]
        ]
        if not going:
            break
        for req in going:
            state[req.request_id].accepted += 1
            req.num_computed += 1  # the draft token's KV is the right one: it is computed
        step += 1
        rows = torch.stack([
            draft_logits[r.request_id][step] if step < len(r.draft) else last_rows[r.request_id]
            for r in going
        ])  # fmt: skip
        for req, tok, lp in sample(rows, going):
            v = state[req.request_id]
            v.tokens.append(tok)
            v.text += add(req, tok, lp)
            if v.logprobs is not None and lp is not None:
                v.logprobs.append(lp)
    return list(state.values())
