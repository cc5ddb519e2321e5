"""`radixserve bench --scenario chaos`: 60 s of chats through a real 2 + 2 cluster while
every kind of fault happens at least once, then the verdicts the benchmark reports.

The end-to-end test (marked ``benchmark``: `make bench-test` runs it, `make test` does
not, as it takes 95–160 s on 2 cores) asserts what must hold on any machine: no wrong answer, no hang,
no unclean failure (every failed request is a clean HTTP error or SSE error event), and
nothing held on any worker once the cluster has settled; and, with two decode workers,
no request failed by a decode worker's death, drain or pause (its streams migrate).
Other clean errors are allowed and reported.

The unit tests check the schedule generator, the client's judgement of replies the
gateway never sends (malformed streams, from an `httpx.MockTransport`: the real gateway
cannot be made to send them), and the report's checking and attribution logic on
hand-made records.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from radixserve.bench.chaos_client import RequestRecord, send_chat
from radixserve.bench.chaos_faults import EventRecord
from radixserve.bench.chaos_reference import Answer
from radixserve.bench.chaos_report import attribute, build_report, check, format_table
from radixserve.bench.chaos_schedule import KINDS, TP_KINDS, build_schedule
from radixserve.cli import main


@pytest.mark.slow
@pytest.mark.benchmark  # ~95 s on 2 cores: `make bench-test`, not `make test`
def test_sixty_seconds_of_chaos(tmp_path: Path, capsys) -> None:
    out = tmp_path / "chaos.json"
    code = main(["bench", "--scenario", "chaos", "--seconds", "60", "--out", str(out)])
    report = json.loads(out.read_text())
    assert_served_through(report)
    assert set(report["events_applied"]) == set(KINDS)
    assert code == 0
    assert "| kill-decode |" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.benchmark  # ~100 s on 2 cores
def test_sixty_seconds_of_chaos_with_tensor_parallel_decode_workers(
    tmp_path: Path, tiny_model: str, capsys
) -> None:
    """Decode workers of TP=2 (the tiny model: one KV head per rank), and kill-rank among
    the events: a worker whose rank is killed exits, its streams move, none is wrong."""
    out = tmp_path / "chaos.json"
    code = main(["bench", "--scenario", "chaos", "--seconds", "60", "--decode-tp", "2",
                 "--model", tiny_model, "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert_served_through(report)
    assert report["events_applied"]["kill-rank"] >= 1, report["events"]
    assert code == 0
    assert "| kill-rank |" in capsys.readouterr().out


def assert_served_through(report: dict) -> None:
    """No wrong answer, hang or unclean failure; every event applied and recovered from;
    nothing held at the end."""
    q = report["requests"]
    failures = report["failed_requests"] + report["problems"]
    assert q["wrong_answers"] == 0, report["problems"]
    assert q["hangs"] == 0 and q["unclean_failures"] == 0, failures
    assert report["settled"] and report["left_held"] == {}, report["held_at_end"]
    assert set(report["held_at_end"]) == {"kvstore", "prefill-0", "prefill-1", "decode-0",
                                          "decode-1"}  # fmt: skip
    assert all(n >= 1 for n in report["events_applied"].values()), report["events"]
    decode_causes = {cause: n for outcome in report["failures_by_cause"].values()
                     for cause, n in outcome.items() if "decode" in cause or "rank" in cause}  # fmt: skip
    assert sum(decode_causes.values()) == 0, (decode_causes, report["failed_requests"])
    assert q["checked"] == q["completed"] >= 10
    assert q["client_drops"] >= 1
    # every killed or drained process came back under a new generation, a paused one resumed
    assert all(e["back_up_s"] is not None for e in report["events"]
               if e["at_s"] is not None and e["kind"] != "client-drop"), report["events"]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--decode", "1"], "--decode must be at least 2 for chaos"),
        (["--seconds", "10"], "--seconds must be in [30, 86400]"),
        (["--quick"], "--quick: --scenario chaos runs its own chats"),
        (["--kv-cache-gib", "1"], "--kv-cache-gib: --scenario chaos runs its own chats"),
        (["--decode-tp", "0"], "--decode-tp must be 1 or more"),
    ],
)
def test_chaos_refuses_what_it_does_not_take(flags: list[str], message: str, capsys) -> None:
    assert main(["bench", "--scenario", "chaos", *flags]) != 0
    assert message in capsys.readouterr().err


def test_seconds_only_with_chaos(capsys) -> None:
    assert main(["bench", "--scenario", "engine", "--seconds", "60"]) != 0
    assert "--seconds applies to --scenario chaos only" in capsys.readouterr().err


# --- the schedule -----------------------------------------------------------------------


@pytest.mark.parametrize("kinds", [KINDS, TP_KINDS])
@pytest.mark.parametrize("seed", range(8))
def test_a_sixty_second_schedule_holds_every_kind(seed: int, kinds: tuple[str, ...]) -> None:
    events = build_schedule(60, seed, kinds=kinds)
    assert sorted(e.kind for e in events[: len(kinds)]) == sorted(kinds)
    assert len(kinds) <= len(events) <= len(kinds) + 1
    assert all(4.0 <= e.at_s <= 52.0 for e in events)
    assert [e.at_s for e in events] == sorted(e.at_s for e in events)
    roles = {e.kind: e.role for e in events[: len(kinds)]}
    assert {roles["drain"], roles["pause"]} == {"prefill", "decode"}
    assert roles["kill-decode"] == "decode" and roles["client-drop"] is None
    assert roles.get("kill-rank", "decode") == "decode"
    assert build_schedule(60, seed, kinds=kinds) == events  # seeded


def test_a_long_schedule_repeats_rounds_about_twelve_seconds_apart() -> None:
    events = build_schedule(300, 3)
    gaps = [b.at_s - a.at_s for a, b in zip(events, events[1:])]
    assert all(10.2 - 1e-6 <= g <= 13.8 + 1e-6 for g in gaps)
    for i in range(0, len(events) - len(KINDS) + 1, len(KINDS)):
        assert sorted(e.kind for e in events[i : i + len(KINDS)]) == sorted(KINDS)
    assert build_schedule(300, 4) != events
    with pytest.raises(ValueError, match="no time for events"):
        build_schedule(10, 0)


def test_a_target_is_picked_from_the_sorted_candidates() -> None:
    event = build_schedule(60, 0)[0]
    picked = event.choose(["decode-1", "decode-0"])
    assert picked == event.choose(["decode-0", "decode-1"])
    assert event.choose(["decode-3"]) == "decode-3"


# --- the client's judgement -------------------------------------------------------------


def _judge(body: bytes, status: int = 200, stream: bool = True) -> RequestRecord:
    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body)

    record = RequestRecord(0, 0, 0, stream, [{"role": "user", "content": "hi"}], [1, 2], 8)

    async def go() -> None:
        transport = httpx.MockTransport(reply)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            await send_chat(http, record, hang_s=5, clock=lambda: 1.0)

    asyncio.run(go())
    return record


def _sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


ROLE = '{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
TEXT = '{"choices":[{"index":0,"delta":{"content":"Hello"}}]}'
END = '{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}'
USAGE = '{"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1}}'
ERROR = '{"error":{"message":"decode worker decode-1 its connection closed","type":"server_error","param":null,"code":500}}'  # noqa: E501


def test_a_whole_stream_is_ok_and_a_broken_one_is_unclean() -> None:
    ok = _judge(_sse(ROLE, TEXT, END, USAGE, "[DONE]"))
    assert (ok.outcome, ok.text, ok.finish_reason, ok.completion_tokens) == (
        "ok",
        "Hello",
        "length",
        1,
    )
    assert _judge(_sse(ROLE, TEXT, END, USAGE)).detail == "the stream ended without data: [DONE]"
    assert "without a finish reason" in _judge(_sse(ROLE, TEXT, USAGE, "[DONE]")).detail
    assert "text after the finish reason" in _judge(_sse(ROLE, END, TEXT, "[DONE]")).detail
    assert "not JSON" in _judge(_sse(ROLE, "{oops", "[DONE]")).detail
    assert _judge(b"event: x\n\n").outcome == "unclean"


def test_an_error_event_or_error_object_is_clean_and_anything_else_is_not() -> None:
    event = _judge(_sse(ROLE, TEXT, ERROR, "[DONE]"))
    assert event.outcome == "error" and event.text == "Hello"
    assert "decode-1" in event.error["message"]
    refused = _judge(ERROR.encode(), status=503, stream=False)
    assert (refused.outcome, refused.status) == ("error", 503)
    bare = _judge(b"Internal Server Error", status=500, stream=False)
    assert bare.outcome == "unclean" and "without an OpenAI error object" in bare.detail
    assert _judge(b'{"choices": []}', stream=False).outcome == "unclean"


# --- checking and attribution -----------------------------------------------------------


def _record(i: int, outcome: str, text: str, start: float, end: float, **kw) -> RequestRecord:
    r = RequestRecord(i, i, 0, True, [], [7, 8, 9], 4, started_s=start, ended_s=end,
                      outcome=outcome, text=text, **kw)  # fmt: skip
    return r


def test_answers_are_checked_and_failures_attributed() -> None:
    answer = Answer("one two", "length", 4)
    good = _record(0, "ok", "one two", 0, 3, finish_reason="length", prompt_tokens=3,
                   completion_tokens=4)  # fmt: skip
    wrong = _record(1, "ok", "one too", 0, 3, finish_reason="length", prompt_tokens=3,
                    completion_tokens=4)  # fmt: skip
    assert check(good, answer) is None
    assert "the reference" in (check(wrong, answer) or "")
    assert check(_record(2, "error", "one", 0, 1), answer) is None  # a prefix: clean
    assert "not a prefix" in (check(_record(3, "error", "one one", 0, 1), answer) or "")

    kill = EventRecord("kill-decode", "decode", 10, "decode-1", at_s=10.0, back_up_s=8.0)
    pause = EventRecord("pause", "prefill", 30, "prefill-0", at_s=30.0, back_up_s=7.0)
    named = _record(4, "error", "", 9, 11,
                    error={"message": "decode worker decode-1 silent for 5.1 s"})  # fmt: skip
    assert attribute(named, [kill, pause]) == "kill-decode"
    assert attribute(_record(5, "hang", "", 36, 40), [kill, pause]) == "pause-prefill"
    assert attribute(_record(6, "unclean", "", 45, 50), [kill, pause]) == "unattributed"

    records = [good, wrong, named, _record(7, "error", "one one", 31, 32)]
    answers = {((7, 8, 9), 4): answer}
    final = {"gateway_in_flight": 0, "workers": {
        "decode-1": {"up": True, "live_requests": 0, "cache_locks": 1, "tasks": 0},
        "decode-0": {"up": False, "live_requests": 3}}}  # fmt: skip
    header = {"seconds": 60, "seed": 0, "num_prefill": 2, "num_decode": 2}
    report = build_report(records, [kill, pause], answers, final, header)
    q = report["requests"]
    assert (q["started"], q["completed"], q["checked"], q["wrong_answers"]) == (4, 2, 2, 1)
    assert (q["clean_errors"], q["unclean_failures"]) == (2, 1)  # 7 streamed wrong text
    assert report["failures_by_cause"]["error"] == {"kill-decode": 1, "pause-prefill": 1}
    assert report["left_held"] == {"decode-1": {"cache_locks": 1}}  # decode-0 is down
    assert kill.first_ok_s is None  # every correct answer started before the kill
    assert "| kill-decode | 1 (0) | 1 |" in format_table(report)


def test_the_report_sums_the_speculation_counters_of_the_workers_up():
    from radixserve.bench.chaos_report import speculation

    workers = {
        "decode-0": {"up": True, "speculative_prompt_drafted_total": 10,
                     "speculative_prompt_accepted_total": 6, "speculative_radix_drafted_total": 4,
                     "speculative_radix_accepted_total": 1},
        "decode-1": {"up": False, "speculative_prompt_drafted_total": 99},
        "kvstore": {"up": True},
    }  # fmt: skip
    assert speculation(workers) == {"drafted": 14, "accepted": 7}
