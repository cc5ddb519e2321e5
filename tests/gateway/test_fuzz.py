"""Fuzzing the gateway from its own /openapi.json (schemathesis): request bodies made
from the documented models, valid and invalid, never get a 5xx, an undocumented status
or content type, or a response that breaks the documented schema; a 400 names the field
(the Messages API's errors are Anthropic's objects); and nothing leaks.

Bounded: a small context (48 tokens), 4 requests in flight, 4 choices per request, a
few dozen examples per operation and about a minute in all."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from radixserve.engine.async_engine import AsyncEngine
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from tests.engine.engine_helpers import TINY, make_engine
from tests.gateway.conftest import RunningServer, wait_idle

BUDGET_S = 60.0


MESSAGES = {"POST /v1/messages", "POST /v1/messages/count_tokens"}
ANTHROPIC_TYPES = {"invalid_request_error", "authentication_error", "permission_error",
                   "not_found_error", "request_too_large", "rate_limit_error", "api_error",
                   "overloaded_error", "timeout_error"}  # fmt: skip
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def field_named(message: str) -> str | None:
    """The top-level field a message begins with: a name (``max_tokens must be ...``), or
    one that is no identifier spelled as the request would index it (``["\\u001f x"] is not
    a field ...``); None if it begins with neither."""
    if message.startswith('["'):
        try:
            name, end = json.JSONDecoder().raw_decode(message, 1)
        except ValueError:
            return None
        return name if message[end : end + 1] == "]" else None
    field = _FIELD.match(message)
    return field[0] if field else None


def _anthropic_error(response, case) -> None:
    """Every 4xx of the Messages API is Anthropic's error object; a 400 to a JSON object
    begins with the field at fault (one the body has, or a required one it lacks)."""
    if response.status_code < 400:
        return
    body = response.json()
    if set(body) != {"type", "error"} or body["type"] != "error" or set(body["error"]) != {
        "type", "message"} or body["error"]["type"] not in ANTHROPIC_TYPES:  # fmt: skip
        raise AssertionError(f"{case.operation.label}: not Anthropic's error object: {body}")
    if response.status_code != 400 or not isinstance(case.body, dict):
        return
    message = body["error"]["message"]
    if field_named(message) not in {*case.body, "model", "messages", "max_tokens"}:
        raise AssertionError(f"{case.operation.label} {case.body}: a 400 not naming the "
                             f"field: {message}")  # fmt: skip


@schemathesis.check
def names_the_field(ctx, response, case) -> None:
    """A 400 to a JSON object names the field at fault: ``error.param`` is set and the
    message says it (the Messages API: `_anthropic_error`)."""
    if case.operation.label in MESSAGES:
        _anthropic_error(response, case)
        return
    if response.status_code != 400 or not isinstance(case.body, dict):
        return
    error = response.json()["error"]
    if not error["param"] or error["param"] not in error["message"]:
        raise AssertionError(f"{case.operation.label} {case.body}: a 400 not naming the field: "
                             f"{error}")  # fmt: skip


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, names_the_field]  # fmt: skip
MODES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 10}


@pytest.fixture(scope="module")
def fuzz_server():
    # the HTTP surface over any model: the tiny random one answers in a hundredth of the time
    engine = make_engine(TINY, kv_cache_memory_gib=0.05, max_model_len=48)
    client = LocalEngineClient(AsyncEngine(engine))
    server = RunningServer(
        create_app(client, GatewaySettings(max_queued_requests=4, max_choices_per_request=4))
    )
    yield server
    server.stop()
    client.close()


def _fuzz(op, mode, examples: int, deadline: float, url: str, served: dict[str, int]) -> int:
    """Run up to ``examples`` generated cases of one operation until ``deadline``; the
    number of calls made. 200 responses are counted in ``served``."""
    calls = 0

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case) -> None:
        nonlocal calls
        if time.monotonic() > deadline:
            return
        calls += 1
        if op.label == "POST /v1/messages" and isinstance(case.body, dict) and calls % 2:
            case.body["model"] = "default"  # a served model: the rest of the body is fuzzed
        response = case.call_and_validate(base_url=url, checks=CHECKS, timeout=60)
        if response.status_code == 200:
            served[op.label] = served.get(op.label, 0) + 1

    run()
    return calls


@pytest.mark.slow
def test_fuzz_gateway_from_its_openapi(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    deadline = time.monotonic() + BUDGET_S
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {op.label for op in operations}
    generating = {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses",
                  "POST /v1/messages"}  # fmt: skip
    stored = {"GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}"}
    assert generating | stored | MESSAGES | {"POST /tokenize", "POST /detokenize",
                                             "GET /version"} <= labels  # fmt: skip
    shares = {op.label: 4.0 if op.label in generating else 1.0 for op in operations}
    served: dict[str, int] = {}  # operation -> 200 responses
    calls = 0
    for op in operations:
        share = BUDGET_S * shares[op.label] / sum(shares.values())
        op_deadline = min(deadline, time.monotonic() + share)
        for mode, examples in MODES.items():
            if mode is GenerationMode.NEGATIVE and op.method.upper() != "POST":
                continue  # a GET without parameters has nothing to make invalid
            calls += _fuzz(op, mode, examples, op_deadline, fuzz_server.url, served)
    assert calls >= 2 * len(operations)
    assert generating <= set(served), served  # real generations ran, not only refusals
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as http:
        stats = wait_idle(http, timeout=60)
        assert stats["live_requests"] == 0 and stats["gateway_in_flight"] == 0, stats
        assert stats["pages_locked"] == 0, stats
