"""The sampling wire structs: every `SamplingParams` field survives the wire, log-
probabilities travel in `TokenChunk` and `KVReady`, and bad values are refused where
they arrive."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import msgpack
import pytest

from radixserve.engine.outputs import RequestOutput, TokenLogprob
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.wire import to_chunk, to_entries, to_logprob, to_output, to_params, to_spec
from radixserve.protocol import (
    GenerateRequest,
    KVReady,
    LogprobEntry,
    PrefillRequest,
    ProtocolError,
    SamplingSpec,
    TokenChunk,
    decode,
    encode,
)


def test_every_sampling_param_round_trips():
    params = SamplingParams(
        max_tokens=9, min_tokens=2, temperature=0.7, top_p=0.9, top_k=40, seed=-5,
        stop=("x",), stop_token_ids=(3,), ignore_eos=True, n=3, logprobs=4,
        prompt_logprobs=2, presence_penalty=-1.5, frequency_penalty=0.25,
        repetition_penalty=1.2, logit_bias={7: -3.0, 2: 1.5}, min_p=0.1,
        guide_kind="json_schema", guide='{"type": "object"}', kept_special_ids=(4, 8),
    )  # fmt: skip
    msg = GenerateRequest("r", (1, 2), sampling=to_spec(params))
    back = decode(encode(msg))
    assert isinstance(back, GenerateRequest)
    assert to_params(back.sampling) == params


def test_the_thinking_budget_round_trips():
    """(Not with a guide: the two are refused together.) Every `SamplingParams` field has
    a wire field, so none is dropped on the way to a cluster worker."""
    params = SamplingParams(max_tokens=9, thinking_token_budget=3, thinking_start_ids=(4, 5),
                            thinking_end_ids=(6,), thinking_open=True)  # fmt: skip
    for msg in (GenerateRequest("r", (1, 2), sampling=to_spec(params)),
                PrefillRequest("r", (1, 2), (0,), sampling=to_spec(params))):  # fmt: skip
        back = decode(encode(msg))
        assert isinstance(back, type(msg))
        assert to_params(back.sampling) == params
    wire = {f.name for f in dataclasses.fields(SamplingSpec)}
    assert {f.name for f in dataclasses.fields(SamplingParams)} - wire == {"logit_bias"}


def test_logprobs_travel_in_token_chunks_and_kv_ready():
    lp = TokenLogprob(5, -0.25, (5, 9), (-0.25, -1.5))
    out = RequestOutput("r", [5], "a", False, "stop", 3, 1, 1.0, index=2, logprobs=[lp],
                        prompt_logprobs=[lp, lp])  # fmt: skip
    chunk = decode(encode(to_chunk(out)))
    assert isinstance(chunk, TokenChunk)
    assert to_output(chunk) == out  # a choice that ended before the request did
    ready = KVReady("r", (5, 6), first_logprobs=to_entries([lp, lp]),
                    prompt_logprobs=to_entries([lp]))  # fmt: skip
    back = decode(encode(ready))
    assert isinstance(back, KVReady)
    assert [to_logprob(e) for e in back.first_logprobs] == [lp, lp]


@pytest.mark.parametrize(
    "bad",
    [
        {"logprobs": [{"token_id": 1, "logprob": 0.0}]},  # one entry for no token
        {"finished": True},  # finished without a reason
        {"token_ids": [1], "logprobs": [{"token_id": 1, "logprob": "x"}]},
        {"token_ids": [1], "logprobs": [{"token_id": 1, "logprob": -1.0, "top_ids": [2]}]},
    ],
)
def test_bad_chunks_are_refused(bad):
    body = {"type": "token_chunk", "v": [1, 3], "request_id": "r", **bad}
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(body))


def test_logit_bias_lists_must_pair():
    with pytest.raises(ProtocolError, match="logit_bias"):
        encode(
            GenerateRequest(
                "r", (1,), sampling=SamplingSpec(logit_bias_ids=(1, 2), logit_bias_values=(1.0,))
            )
        )
    assert to_logprob(LogprobEntry(1, -1.0)) == TokenLogprob(1, -1.0)


def test_the_protocol_package_imports_nothing_of_the_engine():
    """`radixserve.protocol` is a leaf: the gateway, kvstore and clients load it without
    torch, the model or the engine (the conversions are `radixserve.engine.wire`)."""
    code = (
        "import sys, radixserve.protocol, radixserve.protocol.channel;"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(("
        "'radixserve.engine', 'radixserve.model', 'radixserve.cache', 'radixserve.services')));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
