"""A request's deadline (`deadline`): the ``timeout`` body field or the X-Request-Timeout
header aborts a long generation with a 408 naming it (a stream: that error, then
[DONE]), on a real gateway over HTTP; bad values are a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.absent_clients import metric
from tests.gateway.conftest import assert_openai_error, wait_idle
from tests.gateway.test_http_server import LONG

ABORTED = "radixserve_gateway_aborted_requests_total"
CHAT = {**LONG, "messages": [{"role": "user", "content": "Count."}]}


@pytest.fixture
def http(tiny_gateway) -> Iterator[httpx.Client]:
    _, client = tiny_gateway(max_request_timeout_s=60)
    yield client


def assert_aborted_for_its_deadline(http: httpx.Client) -> None:
    stats = wait_idle(http, timeout=60)
    assert (stats["live_requests"], stats["pages_locked"], stats["gateway_in_flight"]) == (0, 0, 0)
    assert metric(http, ABORTED, reason="deadline") == 1
    assert metric(http, "radixserve_requests_total", finish_reason="length") == 0


def test_a_deadline_in_the_body_aborts_a_long_completion(http) -> None:
    resp = http.post("/v1/completions", json={**LONG, "prompt": "Count.", "timeout": 1.5})
    error = assert_openai_error(resp, 408)
    assert error["param"] == "timeout" and "deadline" in error["message"], error
    assert_aborted_for_its_deadline(http)


def test_a_deadline_in_the_header_ends_a_stream_with_its_error(http) -> None:
    events = []
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                     headers={"X-Request-Timeout": "1.5"}) as resp:  # fmt: skip
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 408 and error["param"] == "X-Request-Timeout", error
    assert len(events) > 3  # it streamed before its deadline
    assert_aborted_for_its_deadline(http)


def test_a_deadline_aborts_a_response(http) -> None:
    body = {
        "model": "default",
        "input": "Count.",
        "max_output_tokens": 6000,
        "temperature": 0,
        "timeout": 1.5,
    }  # greedy: no EOS (the tiny model's 6000 tokens)
    resp = http.post("/v1/responses", json=body)
    assert assert_openai_error(resp, 408)["param"] == "timeout"
    assert_aborted_for_its_deadline(http)


def test_a_request_within_its_deadline_is_served(http) -> None:
    body = {"model": "default", "prompt": "Count.", "max_tokens": 4, "timeout": 60}
    resp = http.post("/v1/completions", json=body, headers={"X-Request-Timeout": "59.5"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"timeout": 0}, {}, "timeout"),
        ({"timeout": -1}, {}, "timeout"),
        ({"timeout": "5"}, {}, "timeout"),
        ({"timeout": 61}, {}, "timeout"),  # over max_request_timeout_s
        ({}, {"X-Request-Timeout": "soon"}, "X-Request-Timeout"),
        ({}, {"X-Request-Timeout": "0"}, "X-Request-Timeout"),
        ({}, {"X-Request-Timeout": "nan"}, "X-Request-Timeout"),
        ({}, {"X-Request-Timeout": "61"}, "X-Request-Timeout"),
    ],
)
def test_a_bad_deadline_is_refused_naming_it(http, body, headers, param) -> None:
    resp = http.post("/v1/chat/completions", json={**CHAT, **body}, headers=headers)
    error = assert_openai_error(resp, 400)
    assert error["param"] == param, error
    assert metric(http, "radixserve_requests_total") == 0
