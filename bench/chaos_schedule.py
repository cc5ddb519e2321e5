"""The chaos benchmark's fault schedule: which event happens when, from a seed.

Seven kinds of event (`KINDS`), and an eighth with tensor-parallel decode workers
(`TP_KINDS`):

    kill-prefill   SIGKILL of a prefill worker          (the supervisor restarts it)
    kill-decode    SIGKILL of a decode worker           (restarted)
    kill-rank      SIGKILL of one rank process of a tensor-parallel decode worker: the
                   worker exits with it (and is restarted)
    kill-kvstore   SIGKILL of the kvstore               (restarted)
    drain          SIGTERM of a prefill or decode worker: it drains, exits 0, and the
                   supervisor starts it again (a rolling restart)
    kill-peer-owner  SIGTERM of a decode worker (it drains, then lingers lending its
                   cached pages to the other workers), then SIGKILL once another worker
                   has asked it for pages (or its linger is over): a peer read whose
                   owner dies costs a recompute (restarted)
    pause          SIGSTOP of a prefill or decode worker for longer than the heartbeat
                   timeout, then SIGCONT (a hung peer, not a dead one)
    client-drop    a client closes its connection in the middle of a stream

The schedule is a list of rounds; each round holds every kind once, in a seeded order,
its drain and its pause on different roles (one prefill, one decode, seeded), so any
run long enough for one round sees every kind. Events are ``gap_s`` apart (±15 %,
seeded), from ``start_s`` until ``quiet_tail_s`` before the load ends. A run too short
for the default gap gets a shorter one, so one round still fits. The target worker
itself is picked when the event runs (among those that are up then, `pick`), with the
event's own seeded number, so the same seed and the same cluster state give the same
targets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("kill-prefill", "kill-decode", "kill-kvstore", "kill-peer-owner", "drain", "pause",
         "client-drop")  # fmt: skip
TP_KINDS = (*KINDS, "kill-rank")
ROLE_OF = {"kill-prefill": "prefill", "kill-decode": "decode", "kill-kvstore": "kvstore",
           "kill-rank": "decode", "kill-peer-owner": "decode"}  # fmt: skip
_JITTER = 0.15


@dataclass(frozen=True)
class PlannedEvent:
    """One event of the schedule."""

    at_s: float  # earliest time, seconds after the load started
    kind: str  # one of KINDS
    role: str | None  # "prefill", "decode" or "kvstore"; None for client-drop
    pick: float  # in [0, 1): which of the eligible targets, when the event runs

    def choose(self, candidates: list[str]) -> str:
        """The target among ``candidates`` (sorted first, so the pick is reproducible)."""
        ordered = sorted(candidates)
        return ordered[min(int(self.pick * len(ordered)), len(ordered) - 1)]


def round_gap_s(
    seconds: float, start_s: float, quiet_tail_s: float, gap_s: float, kinds: int = len(KINDS)
) -> float:
    """The mean gap between events: ``gap_s``, or less if one round would not fit
    between ``start_s`` and ``seconds - quiet_tail_s`` with the largest jitter."""
    window = seconds - start_s - quiet_tail_s
    if window <= 0:
        raise ValueError(
            f"a {seconds:g} s run leaves no time for events (they start at {start_s:g} s and "
            f"stop {quiet_tail_s:g} s before the end)"
        )
    fits = window / ((kinds - 1) * (1 + _JITTER))
    return min(gap_s, fits)


def build_schedule(
    seconds: float,
    seed: int,
    *,
    start_s: float = 4.0,
    quiet_tail_s: float = 8.0,
    gap_s: float = 12.0,
    kinds: tuple[str, ...] = KINDS,
) -> list[PlannedEvent]:
    """The events of a ``seconds``-long load, seeded by ``seed`` (see the module doc),
    rounds of ``kinds`` (`TP_KINDS` where decode workers have ranks to kill)."""
    rng = random.Random(f"chaos-schedule-{seed}")
    gap = round_gap_s(seconds, start_s, quiet_tail_s, gap_s, len(kinds))
    last_s = seconds - quiet_tail_s
    events: list[PlannedEvent] = []
    at = start_s
    while True:
        for kind, role in _round(rng, kinds):
            if at > last_s:
                return events
            events.append(PlannedEvent(round(at, 3), kind, role, rng.random()))
            at += gap * rng.uniform(1 - _JITTER, 1 + _JITTER)


def _round(rng: random.Random, of: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """Every kind once with its role, in a seeded order; the round's drain and pause
    target different roles."""
    kinds = list(of)
    rng.shuffle(kinds)
    roles = ["prefill", "decode"]
    rng.shuffle(roles)
    either = {"drain": roles[0], "pause": roles[1]}
    return [(kind, ROLE_OF.get(kind) or either.get(kind)) for kind in kinds]
