"""Wire structs of sampling: `SamplingSpec` (a request's `SamplingParams`) and
`LogprobEntry` (a token's log-probability with its alternatives), nested in the
messages of `radixserve.protocol.messages` (whose `PROTOCOL_VERSION` covers them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.protocol.wire import (
    MAX_TEXT_CHARS,
    MAX_TOKENS_PER_MESSAGE,
    TOKEN_ID,
    BoolSpec,
    FloatSpec,
    IntSpec,
    ListSpec,
    NestedSpec,
    OptionalSpec,
    StrSpec,
    WireStruct,
)
from radixserve.protocol.wire import field_spec as _spec


@dataclass(frozen=True)
class SamplingSpec(WireStruct):
    """Sampling parameters as wire data; bounds here are sanity limits only.

    The semantic checks (min_tokens <= max_tokens, stop-string limits, ...) belong to
    `SamplingParams`: `radixserve.engine.wire.to_params` raises `InvalidRequestError`
    when they fail. The
    logit biases travel as two parallel lists.
    """

    max_tokens: int = field(default=256, metadata=_spec(IntSpec(1, 2**31 - 1)))
    min_tokens: int = field(default=0, metadata=_spec(IntSpec(0, 2**31 - 1)))
    temperature: float = field(default=1.0, metadata=_spec(FloatSpec(0.0, 1e6)))
    top_p: float = field(default=1.0, metadata=_spec(FloatSpec(0.0, 1.0)))
    top_k: int = field(default=0, metadata=_spec(IntSpec(-1, 2**31 - 1)))
    seed: int | None = field(
        default=None, metadata=_spec(OptionalSpec(IntSpec(-(2**63), 2**64 - 1)))
    )
    stop: tuple[str, ...] = field(default=(), metadata=_spec(ListSpec(StrSpec(4096), 64)))
    stop_token_ids: tuple[int, ...] = field(default=(), metadata=_spec(ListSpec(TOKEN_ID, 4096)))
    ignore_eos: bool = field(default=False, metadata=_spec(BoolSpec()))
    n: int = field(default=1, metadata=_spec(IntSpec(1, 4096)))
    logprobs: int | None = field(default=None, metadata=_spec(OptionalSpec(IntSpec(0, 4096))))
    prompt_logprobs: int | None = field(
        default=None, metadata=_spec(OptionalSpec(IntSpec(0, 4096)))
    )
    presence_penalty: float = field(default=0.0, metadata=_spec(FloatSpec(-1e6, 1e6)))
    frequency_penalty: float = field(default=0.0, metadata=_spec(FloatSpec(-1e6, 1e6)))
    repetition_penalty: float = field(default=1.0, metadata=_spec(FloatSpec(0.0, 1e6)))
    logit_bias_ids: tuple[int, ...] = field(default=(), metadata=_spec(ListSpec(TOKEN_ID, 4096)))
    logit_bias_values: tuple[float, ...] = field(
        default=(), metadata=_spec(ListSpec(FloatSpec(-1e6, 1e6), 4096))
    )
    min_p: float = field(default=0.0, metadata=_spec(FloatSpec(0.0, 1.0)))
    guide_kind: str = field(default="", metadata=_spec(StrSpec(32)))
    guide: str = field(default="", metadata=_spec(StrSpec(MAX_TEXT_CHARS)))
    kept_special_ids: tuple[int, ...] = field(default=(), metadata=_spec(ListSpec(TOKEN_ID, 64)))
    thinking_token_budget: int | None = field(
        default=None, metadata=_spec(OptionalSpec(IntSpec(0, 2**31 - 1)))
    )
    thinking_start_ids: tuple[int, ...] = field(default=(), metadata=_spec(ListSpec(TOKEN_ID, 64)))
    thinking_end_ids: tuple[int, ...] = field(default=(), metadata=_spec(ListSpec(TOKEN_ID, 64)))
    thinking_open: bool = field(default=False, metadata=_spec(BoolSpec()))

    def invariant_error(self) -> str | None:
        if len(self.logit_bias_ids) != len(self.logit_bias_values):
            return "logit_bias_ids and logit_bias_values must have the same length"
        return None


@dataclass(frozen=True)
class LogprobEntry(WireStruct):
    """A token's log-probability and its top alternatives (`TokenLogprob` on the wire)."""

    token_id: int = field(metadata=_spec(TOKEN_ID))
    logprob: float = field(metadata=_spec(FloatSpec(-1e30, 1.0)))
    top_ids: tuple[int, ...] = field(default=(), metadata=_spec(ListSpec(TOKEN_ID, 4096)))
    top_logprobs: tuple[float, ...] = field(
        default=(), metadata=_spec(ListSpec(FloatSpec(-1e30, 1.0), 4096))
    )

    def invariant_error(self) -> str | None:
        if len(self.top_ids) != len(self.top_logprobs):
            return "top_ids and top_logprobs must have the same length"
        return None


LOGPROB_ENTRIES = ListSpec(NestedSpec(LogprobEntry), MAX_TOKENS_PER_MESSAGE)
