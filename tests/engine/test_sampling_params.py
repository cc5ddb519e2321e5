"""SamplingParams: defaults, coercion of lists, and one rejection per bad field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from radixserve.engine.sampling_params import MAX_STOP_STRINGS, SamplingParams
from radixserve.errors import InvalidRequestError


def test_defaults_are_valid_and_not_greedy() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k) == (256, 0, 1.0, 1.0, 0)
    assert p.seed is None and p.stop == () and p.stop_token_ids == () and not p.ignore_eos
    assert not p.greedy


def test_lists_become_tuples_and_object_is_frozen_and_hashable() -> None:
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[5, 7], temperature=1)
    assert p.stop == ("a", "bc") and p.stop_token_ids == (5, 7)
    assert isinstance(p.temperature, float)
    assert hash(p) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(5, 7)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 3  # type: ignore[misc]


def test_single_stop_string_is_one_stop() -> None:
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.5, "top_k": 2}, False),
        ({"top_k": -1}, False),
    ],
)
def test_greedy_property(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 100.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * 10_000]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["7"]}, "stop_token_ids"),
        ({"kept_special_ids": [-1]}, "kept_special_ids"),
        ({"kept_special_ids": list(range(17))}, "kept_special_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_bad_field_is_rejected_naming_it(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field


def test_boundaries_are_accepted() -> None:
    SamplingParams(max_tokens=1, min_tokens=1, temperature=100.0, top_p=1e-9, top_k=-1)
    SamplingParams(seed=-(2**63), stop=["s"] * MAX_STOP_STRINGS)
    SamplingParams(seed=2**64 - 1, temperature=0)


def test_replace_revalidates() -> None:
    p = SamplingParams(max_tokens=10, min_tokens=5)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        dataclasses.replace(p, max_tokens=4)
