"""The engine's types to and from the wire structs of `radixserve.protocol`.

The protocol package knows nothing of the engine (it is a leaf: codec, messages, wire
specs); the conversions live here, on the engine's side, and the services call them at
the edge: `to_spec`/`to_params` for a request's sampling, `to_chunk`/`to_output` for an
output on its way to the gateway, `to_entries`/`to_logprob` for log-probabilities,
`share_fields`/`to_share` for a request's tenant, priority and weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypedDict

from radixserve.engine.fair_share import TenantShare
from radixserve.engine.outputs import RequestOutput, TokenLogprob
from radixserve.engine.sampling_params import SamplingParams
from radixserve.protocol.messages import GenerateRequest, PrefillRequest, TokenChunk
from radixserve.protocol.sampling import LogprobEntry, SamplingSpec

_SPEC_FIELDS = [f.name for f in dataclasses.fields(SamplingSpec)]


def to_spec(params: SamplingParams) -> SamplingSpec:
    """The wire form of ``params`` (the logit biases as two parallel lists)."""
    names = [name for name in _SPEC_FIELDS if not name.startswith("logit_bias")]
    return SamplingSpec(
        **{name: getattr(params, name) for name in names},
        logit_bias_ids=tuple(t for t, _ in params.logit_bias),
        logit_bias_values=tuple(b for _, b in params.logit_bias),
    )


def to_params(spec: SamplingSpec) -> SamplingParams:
    """The engine's `SamplingParams` for ``spec``; its semantic checks run here (raises
    `InvalidRequestError`), the spec's own bounds are sanity limits only."""
    values = {name: getattr(spec, name) for name in _SPEC_FIELDS}
    ids, biases = values.pop("logit_bias_ids"), values.pop("logit_bias_values")
    return SamplingParams(**values, logit_bias=tuple(zip(ids, biases)))


def to_entry(lp: TokenLogprob) -> LogprobEntry:
    return LogprobEntry(lp.token_id, lp.logprob, tuple(lp.top_ids), tuple(lp.top_logprobs))


def to_entries(lps: Sequence[TokenLogprob] | None) -> tuple[LogprobEntry, ...]:
    """The wire form of a list of log-probabilities (None: empty)."""
    return tuple(to_entry(lp) for lp in lps or ())


def to_logprob(entry: LogprobEntry) -> TokenLogprob:
    return TokenLogprob(entry.token_id, entry.logprob, entry.top_ids, entry.top_logprobs)


def _to_logprobs(entries: Sequence[LogprobEntry]) -> list[TokenLogprob] | None:
    return [to_logprob(e) for e in entries] if entries else None


# the fields a `RequestOutput` and its `TokenChunk` share, name for name
_SHARED_FIELDS = (
    "request_id", "finished", "finish_reason", "prompt_tokens", "cached", "completion_tokens",
    "ttft_ms", "index", "route", "prefill_worker",
)  # fmt: skip


def to_chunk(out: RequestOutput) -> TokenChunk:
    """The wire form of one engine step's output for a request."""
    return TokenChunk(
        **{name: getattr(out, name) for name in _SHARED_FIELDS},
        token_ids=tuple(out.new_token_ids),
        text=out.new_text,
        logprobs=to_entries(out.logprobs),
        prompt_logprobs=to_entries(out.prompt_logprobs),
    )


def to_output(chunk: TokenChunk) -> RequestOutput:
    """The `RequestOutput` ``chunk`` carries (the inverse of `to_chunk`)."""
    return RequestOutput(
        **{name: getattr(chunk, name) for name in _SHARED_FIELDS},
        new_token_ids=list(chunk.token_ids),
        new_text=chunk.text,
        logprobs=_to_logprobs(chunk.logprobs),
        prompt_logprobs=_to_logprobs(chunk.prompt_logprobs),
    )


class _ShareFields(TypedDict):
    tenant: str
    priority: int
    tenant_weight: float


def share_fields(share: TenantShare) -> _ShareFields:
    """``share`` as the fields of a `GenerateRequest` or `PrefillRequest`."""
    return {"tenant": share.tenant, "priority": share.priority, "tenant_weight": share.weight}


def to_share(msg: GenerateRequest | PrefillRequest) -> TenantShare:
    """The tenant, priority and weight a request message carries."""
    return TenantShare(msg.tenant, msg.priority, msg.tenant_weight)
