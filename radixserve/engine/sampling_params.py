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

MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


def _is_int(value: object) -> bool:
    """True for ints that are not bools (a JSON `true` must not pass as `1`)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """True for real numbers that are not bools."""
    return isinstance(value, Real) and not isinstance(value, bool)


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a lone string is one stop string, not characters
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if _is_int(value):
                object.__setattr__(self, name, float(value))
        self.validate()

    def validate(self) -> None:
        """Raise `InvalidRequestError` naming the first out-of-range field."""
        self._validate_lengths()
        self._validate_sampling()
        self._validate_stops()

    def _validate_lengths(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                param="max_tokens",
            )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}",
                param="min_tokens",
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(
                f"ignore_eos must be a boolean, got {self.ignore_eos!r}", param="ignore_eos"
            )

    def _validate_sampling(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or not 0.0 <= t <= MAX_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], got {t!r}",
                param="temperature",
            )
        p = self.top_p
        if not _is_real(p) or not math.isfinite(p) or not 0.0 < p <= 1.0:
            raise InvalidRequestError(f"top_p must be a number in (0, 1], got {p!r}", param="top_p")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}",
                param="top_k",
            )
        seed = self.seed
        if seed is not None and (not _is_int(seed) or not SEED_MIN <= seed <= SEED_MAX):
            raise InvalidRequestError(
                f"seed must be null or an integer in [-2**63, 2**64), got {seed!r}",
                param="seed",
            )

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
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(
                    f"stop strings must be non-empty strings, got {s!r}", param="stop"
                )
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {len(s)}",
                    param="stop",
                )
        ids = self.stop_token_ids
        if not isinstance(ids, tuple):
            raise InvalidRequestError(
                f"stop_token_ids must be a list of integers, got {ids!r}", param="stop_token_ids"
            )
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                param="stop_token_ids",
            )
        for token_id in ids:
            if not _is_int(token_id) or token_id < 0:
                raise InvalidRequestError(
                    f"stop_token_ids must be non-negative integers, got {token_id!r}",
                    param="stop_token_ids",
                )

    @property
    def greedy(self) -> bool:
        """True when the choice is deterministic argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1
