"""What the engine hands back: per-step deltas and whole-request results."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.protocol.cached_tokens import CachedTokens

#: What a log-probability of minus infinity is reported as (OpenAI's convention).
NEG_INF_LOGPROB = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the most likely alternatives at its position.

    ``top_ids`` / ``top_logprobs`` are sorted by descending log-probability (equal ones
    in no set order); they may or may not include ``token_id``.
    """

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one choice of a request from one engine step (streaming unit).

    A request with ``n`` choices streams outputs of every choice (``index`` 0..n-1)
    under its one ``request_id``. ``finish_reason`` is set on a choice's last output;
    ``finished`` only on the request's last output, once every choice has ended (for
    n = 1 the two coincide).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" on the choice's last output
    prompt_tokens: int
    completion_tokens: int  # tokens this choice has generated so far
    ttft_ms: float | None
    cached: CachedTokens = field(default_factory=CachedTokens)  # the prompt's, by tier
    index: int = 0  # the choice
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    # when asked for: one per prompt token but the first, on choice 0's first output
    prompt_logprobs: list[TokenLogprob] | None = field(default=None)
    # a prefill worker's request (`Engine.admit` with a lease), on a choice's last output:
    # the pages holding its prompt, kept for the reader until the lease ends
    leased_page_ids: list[int] | None = None
    # in a cluster, on the request's last output: how its prompt got its KV (`Admission.route`),
    # the prefill worker that computed it (route "remote") and the decode worker that served it
    route: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""


@dataclass(frozen=True)
class GenerationResult:
    """A finished request."""

    request_id: str
    text: str
    token_ids: list[int]  # generated tokens only
    prompt_tokens: int
    cached_tokens: int  # the prompt's `CachedTokens.total`
    computed_prompt_tokens: int  # prompt tokens that ran through the model
    finish_reason: str
    ttft_ms: float
    e2e_ms: float
    index: int = 0  # the choice, for requests with n > 1
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None
