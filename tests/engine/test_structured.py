"""Structured output on the tiny random-init model (the guide, not the weights, makes the
shape): for 20 varied JSON schemas, run as one batch, every output parses and validates;
JSON mode gives an object; regex and choice guides give a match; a malformed guide is
refused before anything runs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import InvalidRequestError
from tests.engine.engine_helpers import assert_no_leaks

STR = {"type": "string", "maxLength": 12}
INT = {"type": "integer", "minimum": 0, "maximum": 999}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}  # fmt: skip


SCHEMAS = [
    _obj({"name": STR, "age": INT}),
    _obj({"colour": {"enum": ["red", "green", "blue"]}}),
    _obj({"ok": {"type": "boolean"}, "count": INT}),
    _obj({"values": {"type": "array", "items": INT, "minItems": 1, "maxItems": 3}}),
    _obj({"person": _obj({"first": STR, "last": STR})}),
    _obj({"price": {"type": "number", "minimum": 0, "maximum": 100}}),
    _obj({"id": {"anyOf": [STR, INT]}}),
    _obj({"kind": {"const": "fruit"}, "name": STR}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
    _obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}),
    _obj({"title": STR, "note": STR}, required=["title"]),
    _obj({"empty": {"type": "null"}, "n": INT}),
    _obj({"city": STR, "country": STR, "population": INT}),
    _obj({"items": {"type": "array", "items": _obj({"k": STR}), "minItems": 1, "maxItems": 2}}),
    _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    {"type": "array", "items": INT, "minItems": 2, "maxItems": 4},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"oneOf": [_obj({"cat": STR}), _obj({"dog": INT})]},
    _obj({"matrix": {"type": "array", "maxItems": 2,
                     "items": {"type": "array", "items": INT, "maxItems": 2}}}),
]  # fmt: skip


@pytest.mark.slow
def test_twenty_schemas_validate(tiny_on):
    engine = tiny_on
    prompt = engine.tokenizer.encode_chat(
        [{"role": "user", "content": "Answer with JSON describing a fruit shop."}]
    )
    params = [
        SamplingParams(max_tokens=80, temperature=0.0, guide_kind="json_schema",
                       guide=json.dumps(schema))
        for schema in SCHEMAS
    ]  # fmt: skip
    results = _run(engine, prompt, params)
    for (text, reason), schema in zip(results, SCHEMAS):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    assert_no_leaks(engine)


def _run(engine, prompt, params: list[SamplingParams]) -> list[tuple[str, str]]:
    """(text, finish_reason) of each request, all run as one batch."""
    rids = [engine.add_request(prompt, p) for p in params]
    texts = {rid: "" for rid in rids}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.new_text
            if out.finished:
                reasons[out.request_id] = out.finish_reason or ""
    return [(texts[rid], reasons[rid]) for rid in rids]


@pytest.mark.slow
def test_json_object_regex_and_choice(tiny_on):
    engine = tiny_on
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Give me a code."}])
    (obj, obj_reason), (rx, _), (choice, _) = _run(engine, prompt, [
        SamplingParams(max_tokens=40, temperature=0.0, guide_kind="json_object"),
        SamplingParams(max_tokens=20, temperature=0.7, seed=3, guide_kind="regex",
                       guide=r"[A-Z]{2}-\d{3}"),
        SamplingParams(max_tokens=20, temperature=0.0, guide_kind="choice",
                       guide=json.dumps(["alpha", "beta"])),
    ])  # fmt: skip
    if obj_reason == "stop":  # 40 tokens may cut a free-form object short
        assert isinstance(json.loads(obj), dict)
    else:
        assert obj.startswith("{")
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", rx), rx
    assert choice in ("alpha", "beta")


def test_malformed_guides_are_refused(tiny_on):
    for kind, guide in (("json_schema", "{not json"), ("json_schema", "[1]"),
                        ("regex", "(("), ("choice", "[]"), ("bogus", "")):  # fmt: skip
        with pytest.raises(InvalidRequestError):
            tiny_on.add_request("hi", SamplingParams(guide_kind=kind, guide=guide))
    assert_no_leaks(tiny_on)
