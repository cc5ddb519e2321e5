"""Per-request sampling parameters, validated on construction.

A `SamplingParams` object is immutable and always valid: `__post_init__` runs `validate`,
so a bad value raises `InvalidRequestError` (HTTP 400) naming the field before the
request reaches the engine. `dataclasses.replace` re-validates as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

from radixserve.errors import InvalidRequestError
from radixserve.protocol.wire import is_int

MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKEN_ID = 2**31 - 1  # the wire's bound on token ids and counts
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_CHOICES = 128  # OpenAI's bound on `n`
MAX_LOGPROBS = 20  # OpenAI's bound on `top_logprobs`
MAX_LOGIT_BIAS = 1024
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI)
MAX_REPETITION_PENALTY = 10.0
MAX_GUIDE_CHARS = 1 << 18
MAX_KEPT_SPECIAL_IDS = 16
MAX_THINKING_MARKER_IDS = 16
GUIDE_KINDS = ("", "json_object", "json_schema", "regex", "choice", "lark")


_FLOAT_FIELDS = (
    "temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_p",
)  # fmt: skip


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if not is_int(value) or not lo <= value <= hi:  # type: ignore[operator]
        raise InvalidRequestError(
            f"{name} must be an integer in [{lo}, {hi}], got {value!r}", param=name
        )


def _check_real(name: str, value: object, lo: float, hi: float) -> None:
    real = isinstance(value, Real) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and lo <= value <= hi):  # type: ignore[arg-type,operator]
        raise InvalidRequestError(
            f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}", param=name
        )


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean, got {value!r}", param=name)


def _check_ids(name: str, ids: object, limit: int) -> None:
    if not isinstance(ids, tuple) or len(ids) > limit:
        raise InvalidRequestError(f"{name} must be a list of at most {limit} integers",
                                  param=name)  # fmt: skip
    for token_id in ids:
        _check_int(name, token_id, 0, MAX_TOKEN_ID)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    max_tokens: most tokens to generate (>= 1).
    min_tokens: EOS and `stop_token_ids` are suppressed until this many tokens exist
        (0 <= min_tokens <= max_tokens).
    temperature: logits are divided by it; 0 means greedy (0 <= temperature <= 100).
    top_p: nucleus sampling mass, 0 < top_p <= 1 (1 = off).
    top_k: keep the k most likely tokens; 0 or -1 = off.
    seed: seeds a per-request generator so the same seed gives the same tokens;
        None uses the shared RNG. Any int in [-2**63, 2**64) (taken modulo 2**64).
    stop: strings that end generation; the match is not part of the output.
    stop_token_ids: token ids that end generation (like EOS).
    ignore_eos: keep generating past EOS (the engine's concern, not the sampler's).
    n: choices sampled from one prompt (1..128); the prompt is computed once and the
        choices fork after it, sharing its pages. Choice i seeds its draws from
        (`seed`, i, tokens sampled so far).
    logprobs: with each sampled token, its log-probability and the `logprobs` most
        likely alternatives (0..20); None = none. Log-probabilities are those of the
        raw model distribution: before temperature, penalties, biases and grammar masks.
    prompt_logprobs: the same for every prompt token but the first (0..20); a request
        with it computes its whole prompt (the cached prefix has no logits).
    presence_penalty, frequency_penalty: subtracted from the logit of every token
        already generated, once / once per occurrence ([-2, 2], OpenAI's definition).
    repetition_penalty: logits of tokens in the prompt or output are divided by it when
        positive, multiplied when negative ((0, 10]; 1 = off; vLLM's definition).
    logit_bias: (token id, bias in [-100, 100]) pairs added to the logits.
    min_p: drop tokens whose probability is below min_p times the best one's ([0, 1]).
    guide_kind, guide: structured output; kind "json_object" (guide empty),
        "json_schema" (guide: the schema as JSON), "regex", "choice" (guide: a JSON list
        of strings) or "lark" (a Lark grammar); "" = unconstrained.
    kept_special_ids: special tokens whose text the output keeps (at most 16; every
        other special token is left out of the text): a tool-call parser's markers,
        such as Llama 3's ``<|python_tag|>`` or Mistral's ``[TOOL_CALLS]``.
    thinking_token_budget: most tokens the reply may reason (0..2**31-1; None = no
        cap). Once that many have been generated inside its reasoning, the next tokens
        are forced to `thinking_end_ids` (a mask: only that token is allowed) and the
        model answers after them (`radixserve.engine.thinking_budget`). Reasoning opens
        at the start (`thinking_open`) or when the reply writes `thinking_start_ids`,
        and closes when it writes `thinking_end_ids`; the count covers every reasoning
        segment of the reply. Not with a guide (its grammar decides every token).
    thinking_start_ids, thinking_end_ids: the token ids of the reasoning format's
        start and end markers (at most 16 each; the end marker is needed with a budget).
    thinking_open: the reply starts inside its reasoning (the prompt opened it).
    """

    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    guide_kind: str = ""
    guide: str = ""
    kept_special_ids: tuple[int, ...] = ()
    thinking_token_budget: int | None = None
    thinking_start_ids: tuple[int, ...] = ()
    thinking_end_ids: tuple[int, ...] = ()
    thinking_open: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a lone string is one stop string, not characters
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        for name in ("stop_token_ids", "kept_special_ids", "thinking_start_ids",
                     "thinking_end_ids"):  # fmt: skip
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        elif isinstance(self.logit_bias, list):
            object.__setattr__(self, "logit_bias", tuple(tuple(p) for p in self.logit_bias))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if is_int(value):
                object.__setattr__(self, name, float(value))
        self.validate()

    def validate(self) -> None:
        """Raise `InvalidRequestError` naming the first out-of-range field."""
        self._validate_lengths()
        self._validate_sampling()
        self._validate_stops()
        self._validate_extensions()
        self._validate_thinking()

    def _validate_lengths(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, MAX_TOKEN_ID)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)  # within max_tokens
        _check_bool("ignore_eos", self.ignore_eos)

    def _validate_sampling(self) -> None:
        _check_real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_real("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidRequestError("top_p must be > 0 (1 = off)", param="top_p")
        _check_int("top_k", self.top_k, -1, MAX_TOKEN_ID)  # 0 or -1 disables it
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_MIN, SEED_MAX)

    def _validate_stops(self) -> None:
        if not isinstance(self.stop, tuple):
            raise InvalidRequestError(
                f"stop must be a list of strings, got {self.stop!r}", param="stop"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"stop allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
                param="stop",
            )
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"stop strings must be non-empty strings of at most "
                    f"{MAX_STOP_STRING_CHARS} characters, got {s!r:.80}",
                    param="stop",
                )
        _check_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)

    def _validate_extensions(self) -> None:
        """n, log-probabilities, penalties, biases, min_p and the structured-output guide."""
        _check_int("n", self.n, 1, MAX_CHOICES)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, MAX_LOGPROBS)
        _check_real("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_real("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY)
        if self.repetition_penalty == 0.0:
            raise InvalidRequestError(
                "repetition_penalty must be > 0 (1 = off)", param="repetition_penalty"
            )
        _check_real("min_p", self.min_p, 0.0, 1.0)
        bias = self.logit_bias
        if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases",
                param="logit_bias",
            )
        for pair in bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidRequestError(
                    f"logit_bias entries must be (token id, bias), got {pair!r}", param="logit_bias"
                )
            token_id, value = pair
            _check_int("logit_bias", token_id, 0, MAX_TOKEN_ID)
            _check_real("logit_bias", value, -100.0, 100.0)
        if self.guide_kind not in GUIDE_KINDS:
            raise InvalidRequestError(
                f"guide_kind must be one of {GUIDE_KINDS[1:]}, got {self.guide_kind!r}",
                param="guide_kind",
            )
        if not isinstance(self.guide, str) or len(self.guide) > MAX_GUIDE_CHARS:
            raise InvalidRequestError(
                f"guide must be a string of at most {MAX_GUIDE_CHARS} characters", param="guide"
            )
        _check_ids("kept_special_ids", self.kept_special_ids, MAX_KEPT_SPECIAL_IDS)

    def _validate_thinking(self) -> None:
        """The thinking-token budget and the markers it needs."""
        _check_ids("thinking_start_ids", self.thinking_start_ids, MAX_THINKING_MARKER_IDS)
        _check_ids("thinking_end_ids", self.thinking_end_ids, MAX_THINKING_MARKER_IDS)
        _check_bool("thinking_open", self.thinking_open)
        budget = self.thinking_token_budget
        if budget is None:
            return
        name = "thinking_token_budget"
        _check_int(name, budget, 0, MAX_TOKEN_ID)
        if not self.thinking_end_ids:
            raise InvalidRequestError(f"{name} needs the end-of-thinking marker's token ids "
                                      "(thinking_end_ids)", param=name)  # fmt: skip
        if not self.thinking_open and not self.thinking_start_ids:
            raise InvalidRequestError(f"{name} needs a reply that starts inside its reasoning "
                                      "(thinking_open) or the start marker's token ids "
                                      "(thinking_start_ids)", param=name)  # fmt: skip
        if self.guide_kind:
            raise InvalidRequestError(f"{name} cannot be combined with structured output: its "
                                      "grammar decides every token of the reply", param=name)  # fmt: skip

    @property
    def penalized(self) -> bool:
        """True when a presence, frequency or repetition penalty applies."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        """True when the choice is deterministic argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1
