"""The chaos benchmark's verdicts: answers against the reference, failures by cause,
recovery after each event, what the workers still hold; JSON and one table.

**Checking.** A request that completed (`ok`) is *checked*: its text, finish reason and
completion tokens must equal the reference engine's for the same prompt ids, and the
prompt tokens the gateway reports must be the ids' count; otherwise it is a *wrong
answer*. A request that ended early (error, hang, client drop) must have streamed a
prefix of the reference text; otherwise it is *unclean* (text missing or repeated).

**Attribution** of a failed request (clean error, unclean, hang) to an event:
1. a process the error message names (``decode worker decode-1 ...``, ``prefill-0``,
   ``kvstore``): the latest event on that process before the request ended;
2. else the latest event whose disturbance window — from the event until its target
   was back up (a client drop: the moment itself), plus `_SLACK_S` — overlaps the
   request's lifetime;
3. else ``unattributed``. A cause is the event's kind, with its role for a drain or
   pause (``drain-decode``, ``pause-prefill``).

**Recovery** after an event: until the first request started after it completed
correctly (``first_ok_s``), and until its target was up again (``back_up_s``).

**Held at the end**, per worker that is up (its heartbeat stats at the gateway):
`HELD_KEYS`; each must be 0 once the load has stopped and the cluster has settled.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Any

from radixserve.bench.chaos_client import RequestRecord
from radixserve.bench.chaos_faults import EventRecord
from radixserve.bench.chaos_reference import Answer, Key
from radixserve.bench.chaos_schedule import KINDS, TP_KINDS

HELD_KEYS = (
    "page_refs_outside_cache",  # page references held by anything but the radix cache
    "cache_locks",  # radix cache locks outstanding
    "pages_locked",  # pages under those locks
    "leases",  # prefill pages lent to a reader
    "host_leases",  # kvstore: host-tier page runs leased to a worker
    "host_pages_leased",
    "host_loads_in_flight",  # a worker reading from the host tier
    "live_requests",  # requests in the engine
    "awaiting_kv",  # decode requests waiting for their prefill
    "tasks",  # request tasks of the service
)
_SLACK_S = 2.0
_NAMED = re.compile(r"\b((?:prefill|decode)-\d+|kvstore)\b")


def cause_name(event: EventRecord) -> str:
    return f"{event.kind}-{event.role}" if event.kind in ("drain", "pause") else event.kind


def attribute(record: RequestRecord, events: list[EventRecord]) -> str:
    """The cause of a failed request (see the module doc)."""
    applied = [e for e in events if e.at_s is not None]
    assert record.ended_s is not None
    message = (record.error or {}).get("message", "") + " " + record.detail
    named = set(_NAMED.findall(message))
    before = [e for e in applied if e.at_s is not None and e.at_s <= record.ended_s]
    hits = [e for e in before if e.target in named]
    if hits:
        return cause_name(max(hits, key=lambda e: e.at_s or 0.0))
    overlapping = [e for e in before if _window_end(e) >= record.started_s]
    if overlapping:
        return cause_name(max(overlapping, key=lambda e: e.at_s or 0.0))
    return "unattributed"


def _window_end(event: EventRecord) -> float:
    assert event.at_s is not None
    return event.at_s + (event.back_up_s or 0.0) + _SLACK_S


def check(record: RequestRecord, answer: Answer) -> str | None:
    """What is wrong with ``record`` against the reference ``answer``; None if nothing."""
    if record.outcome == "ok":
        got = (record.text, record.finish_reason, record.completion_tokens)
        want = (answer.text, answer.finish_reason, answer.completion_tokens)
        if got != want:
            return f"answered {got!r}, the reference {want!r}"
        if record.prompt_tokens != len(record.prompt_ids):
            return f"{record.prompt_tokens} prompt tokens, the reference {len(record.prompt_ids)}"
        return None
    if not answer.text.startswith(record.text):
        return f"streamed {record.text!r}, not a prefix of the reference {answer.text!r}"
    return None


def _seconds(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 2), "max": round(max(values), 2)}


def recovery(events: list[EventRecord], records: list[RequestRecord], wrong: set[int]) -> None:
    """Set each applied event's ``first_ok_s``."""
    for event in events:
        if event.at_s is None:
            continue
        after = [r.ended_s for r in records if r.outcome == "ok" and r.request_id not in wrong
                 and r.started_s >= event.at_s and r.ended_s is not None]  # fmt: skip
        event.first_ok_s = round(min(after) - event.at_s, 2) if after else None


def held(workers: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per worker that is up, the `HELD_KEYS` it reports (missing keys left out)."""
    return {
        name: {k: int(w[k]) for k in HELD_KEYS if k in w}
        for name, w in sorted(workers.items())
        if w.get("up")
    }


def build_report(
    records: list[RequestRecord],
    events: list[EventRecord],
    answers: dict[Key, Answer],
    final: dict[str, Any],
    header: dict[str, Any],
) -> dict[str, Any]:
    """The benchmark's JSON: ``final`` is the gateway's /debug/cache after settling."""
    problems: dict[int, str] = {}
    unchecked = 0
    for r in records:
        if r.outcome != "ok" and not r.text:
            continue
        answer = answers.get((tuple(r.prompt_ids), r.max_tokens))
        issue = check(r, answer) if answer is not None else None
        unchecked += answer is None and r.outcome == "ok"
        if issue is not None:
            problems[r.request_id] = issue
    by_id = _by_id(records)
    wrong = {i for i in problems if by_id[i].outcome == "ok"}
    corrupt = {i for i in problems if i not in wrong}
    outcomes = Counter(r.outcome for r in records)
    failed = [r for r in records if r.outcome in ("error", "unclean", "hang")]
    causes: dict[str, Counter] = {o: Counter() for o in ("error", "unclean", "hang")}
    for r in failed:
        causes[r.outcome or "unclean"][attribute(r, events)] += 1
    recovery(events, records, wrong)
    held_now = held(final.get("workers", {}))
    leftover = {w: {k: v for k, v in h.items() if v} for w, h in held_now.items()}
    leftover = {w: h for w, h in leftover.items() if h}
    if final.get("gateway_in_flight"):
        leftover["gateway"] = {"in_flight": int(final["gateway_in_flight"])}
    applied = Counter(e.kind for e in events if e.at_s is not None)
    kinds = TP_KINDS if any(e.kind == "kill-rank" for e in events) else KINDS  # as scheduled
    return {
        **header,
        "requests": {
            "started": len(records),
            "completed": outcomes["ok"],
            "checked": outcomes["ok"] - unchecked,
            "wrong_answers": len(wrong),
            "clean_errors": outcomes["error"],
            "unclean_failures": outcomes["unclean"] + len(corrupt),
            "hangs": outcomes["hang"],
            "client_drops": outcomes["dropped"],
        },
        "failures_by_cause": {o: dict(c) for o, c in causes.items()},
        "problems": [{**by_id[i].summary(), "problem": p} for i, p in sorted(problems.items())],
        "failed_requests": [r.summary() for r in failed],
        "events_applied": {k: applied.get(k, 0) for k in kinds},
        "events": [e.as_dict() for e in events],
        "recovery_by_kind": _recovery_by_kind(events),
        "held_at_end": held_now,
        "left_held": leftover,
        "gateway_in_flight_at_end": int(final.get("gateway_in_flight", 0)),
        "speculation_at_end": speculation(final.get("workers", {})),
    }


def speculation(workers: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Draft tokens verified and kept, summed over the workers up at the end (each
    worker's counters since its last start): nonzero when the cluster speculated."""
    return {what: sum(int(w.get(f"speculative_{m}_{what}_total", 0))
                      for w in workers.values() if w.get("up") for m in ("prompt", "radix"))
            for what in ("drafted", "accepted")}  # fmt: skip


def _by_id(records: list[RequestRecord]) -> dict[int, RequestRecord]:
    return {r.request_id: r for r in records}


def _recovery_by_kind(events: list[EventRecord]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({cause_name(e) for e in events}):
        mine = [e for e in events if cause_name(e) == kind]
        done = [e for e in mine if e.at_s is not None]
        out[kind] = {
            "applied": len(done),
            "skipped": len(mine) - len(done),
            "down_seen_s": _seconds([e.down_seen_s for e in done if e.down_seen_s is not None]),
            "first_ok_s": _seconds([e.first_ok_s for e in done if e.first_ok_s is not None]),
            "back_up_s": _seconds([e.back_up_s for e in done if e.back_up_s is not None]),
        }
    return out


def _fmt(stat: dict[str, float] | None) -> str:
    return "–" if stat is None else f"{stat['median']:.1f} / {stat['max']:.1f}"


def format_table(report: dict[str, Any]) -> str:
    """One markdown table (a row per kind of event) and the totals under it."""
    causes = report["failures_by_cause"]
    lines = [
        f"### Chaos: {report['seconds']:g} s of load, seed {report['seed']}, "
        f"{report['num_prefill']} prefill + {report['num_decode']} decode workers",
        "",
        "| event | applied (skipped) | clean errors | unclean | hangs | gateway saw it "
        "down s | first ok request s | back up s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, rec in report["recovery_by_kind"].items():
        lines.append(
            f"| {kind} | {rec['applied']} ({rec['skipped']}) | {causes['error'].get(kind, 0)} | "
            f"{causes['unclean'].get(kind, 0)} | {causes['hang'].get(kind, 0)} | "
            f"{_fmt(rec['down_seen_s'])} | {_fmt(rec['first_ok_s'])} | {_fmt(rec['back_up_s'])} |"
        )
    loose = {o: c.get("unattributed", 0) for o, c in causes.items()}
    if any(loose.values()):
        lines.append(f"| unattributed | – | {loose['error']} | {loose['unclean']} | "
                     f"{loose['hang']} | – | – | – |")  # fmt: skip
    q = report["requests"]
    left = report["left_held"] or "nothing"
    lines += [
        "",
        "(seconds: median / max over the events of the kind, from the event)",
        f"requests: {q['started']} started, {q['completed']} completed, {q['checked']} "
        f"checked against the reference, {q['wrong_answers']} wrong, {q['clean_errors']} "
        f"clean errors, {q['unclean_failures']} unclean, {q['hangs']} hangs, "
        f"{q['client_drops']} dropped by the client",
        f"held at the end: {left}",
    ]
    spec = report.get("speculation_at_end") or {}
    if spec.get("drafted"):
        lines.append(f"speculative decoding: {spec['drafted']} draft tokens verified, "
                     f"{spec['accepted']} kept (workers up at the end, since their start)")  # fmt: skip
    return "\n".join(lines)
