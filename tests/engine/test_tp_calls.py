"""The calls rank 0 makes of its tensor-parallel ranks: each encodes and decodes to
itself, a frame naming no known call or with the wrong fields is refused naming it, and
every call has its rank handler. (A call run by real ranks: tests/engine/test_tp.py.)"""

from __future__ import annotations

import json
from typing import get_args

import pytest

from radixserve.engine.tp_calls import MapSpillBuffer, Spill, StartAgent, TPCall, decode, encode
from radixserve.engine.tp_rank import HANDLERS

CALLS = [
    StartAgent(
        "zmq",
        "decode-1",
        "ipc:///tmp/x/agents",
        5.0,
        False,
        "127.0.0.1",
        "10.0.0.2",
        7000,
        7100,
        None,
        identity="abc",
    ),  # fmt: skip
    MapSpillBuffer("/dev/shm/spill", [2, 3, 16, 8], "bfloat16"),
    Spill([4, 5, 9], [0, 1, 2]),
]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.OP)
def test_each_call_decodes_to_itself(call: TPCall) -> None:
    assert decode(encode(call)) == call


def test_an_unknown_call_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="unknown tensor-parallel call 'agent'"):
        decode(json.dumps({"op": "agent", "name": "w"}).encode())
    with pytest.raises(TypeError, match="dict is not a tensor-parallel call"):
        encode({"op": "spill"})  # type: ignore[arg-type]


def test_a_call_with_the_wrong_fields_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="malformed tensor-parallel call 'spill'.*pages"):
        decode(json.dumps({"op": "spill", "pages": [1], "slots": [0]}).encode())


def test_every_call_has_its_rank_handler() -> None:
    assert set(HANDLERS) == set(get_args(TPCall))
