"""A discrete-event model of the prefill and decode pools, driven by a scaling policy.

The policy is the autoscaler's own (`ScalingPolicy`, or a baseline with the same
``decide``): every ``interval_s`` the simulator hands it an `Observation` built exactly
as the live metrics source builds one — arrival rates, TTFT and ITL p90 of the interval,
the prefill queue, per-worker counter samples (busy time, prefill tokens and seconds,
decode-only steps, batch sizes and seconds), and the prefill workers' per-request
histograms of uncached tokens and of the wait before a request's own compute, in the
workers' own buckets — and applies its `Decision`s.

The pools (`PoolModel`):

* **prefill**: replicas take requests first-come first-served from one queue; one
  request costs ``uncached tokens / prefill_tokens_per_s + prefill_overhead_s``. Its
  first token is out when it finishes; its KV reaches a decode replica
  ``transfer_s`` later.
* **decode**: continuous batching; a step with B sequences takes ``a + b * B``
  (``decode_step_base_s``, ``decode_step_per_seq_s``), every sequence gets a token per
  step, at most ``max_batch`` run at once (the rest wait, and the wait counts in their
  inter-token latency). A request goes to the replica with the smallest batch.
* a new replica is ready ``startup_s`` after it is asked for, then runs at
  ``cold_speed`` of full speed for ``cold_start_s`` (warm-up); a removed one finishes
  what it holds (drains) and counts until it is done. Replica-seconds count from the ask.

A request meets its SLO when its TTFT and its mean inter-token latency are both within
target (its TTFT target is ``max(ttft target, ttft_per_1k_s × uncached tokens / 1000)``
with a per-token budget). A request is *infeasible* when its own prefill alone — its
uncached tokens at ``prefill_tokens_per_s`` plus ``prefill_overhead_s`` — exceeds that
target: no pool size serves it in time. Everything is deterministic for a trace.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from radixserve.bench.autoscale_trace import TraceRequest
from radixserve.metrics import PREFILL_TOKENS_BUCKETS, PREFILL_WAIT_BUCKETS
from radixserve.services.autoscaler.capacity import WorkerSample
from radixserve.services.autoscaler.feasibility import request_target_s
from radixserve.services.autoscaler.histogram import Histogram
from radixserve.services.autoscaler.observation import Decision, Observation, PoolState

ROLES = ("prefill", "decode")


class Policy(Protocol):
    def decide(self, obs: Observation) -> list[Decision]: ...


@dataclass(frozen=True)
class PoolModel:
    prefill_tokens_per_s: float = 8000.0
    prefill_overhead_s: float = 0.02
    transfer_s: float = 0.01
    decode_step_base_s: float = 0.012
    decode_step_per_seq_s: float = 0.0003
    max_batch: int = 256
    startup_s: float = 45.0
    cold_start_s: float = 20.0
    cold_speed: float = 0.6

    def step_s(self, batch: int) -> float:
        return self.decode_step_base_s + self.decode_step_per_seq_s * batch

    def own_prefill_s(self, tokens: int) -> float:
        """A prompt's prefill on a warm replica with nothing ahead of it."""
        return tokens / self.prefill_tokens_per_s + self.prefill_overhead_s


@dataclass
class _Req:
    trace: TraceRequest
    start_s: float = math.nan  # its prefill starts
    first_s: float = math.nan
    join_s: float = math.nan  # arrival at decode
    done_s: float = math.nan

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.trace.t

    @property
    def itl_s(self) -> float:
        n = self.trace.output_tokens - 1
        return (self.done_s - self.join_s) / n if n > 0 else 0.0


@dataclass
class _Counters:
    busy_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: float = 0.0
    decode_seqs: float = 0.0
    decode_s: float = 0.0


@dataclass
class _Replica:
    role: str
    asked_s: float
    ready_s: float
    draining: bool = False
    gone_s: float | None = None
    counters: _Counters = field(default_factory=_Counters)
    # prefill
    busy_until: float = 0.0
    # decode: a step counter, and per running request the step at which it is done
    steps: float = 0.0
    last_s: float = 0.0
    batch: list[tuple[float, int, _Req]] = field(default_factory=list)
    version: int = 0

    def speed(self, now: float, model: PoolModel) -> float:
        return model.cold_speed if now < self.ready_s + model.cold_start_s else 1.0


@dataclass
class SimResult:
    requests: int
    attainment: float  # share of requests within both targets
    ttft_attainment: float
    itl_attainment: float
    infeasible: int  # requests whose own prefill exceeds their TTFT target
    feasible_attainment: float  # share of the feasible requests within both targets
    replica_seconds: dict[str, float]
    scale_events: dict[str, int]
    timeline: list[dict[str, float | None]]  # one point per interval


class Simulator:
    """Replays ``trace`` against the pools under ``policy``; `run` returns the outcome."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        policy: Policy,
        model: PoolModel,
        initial: dict[str, int],
        interval_s: float,
        targets: tuple[float, float],  # (TTFT p90, ITL p90) in seconds
        ttft_per_1k_s: float | None = None,  # a per-token TTFT budget (off: None)
    ) -> None:
        self.trace, self.policy, self.model = trace, policy, model
        self.interval_s, self.targets = interval_s, targets
        self.ttft_per_1k_s = ttft_per_1k_s
        self.replicas: list[_Replica] = []
        warm = -model.cold_start_s - 1.0  # the initial replicas start warm
        for role in ROLES:
            for _ in range(initial[role]):
                self.replicas.append(_Replica(role, warm - model.startup_s, warm))
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._queue: deque[_Req] = deque()  # waiting for prefill
        self._waiting_decode: deque[_Req] = deque()  # waiting for a decode slot
        self._done: list[_Req] = []
        self._window: dict[str, list] = {"arrived": [], "first": [], "done": []}
        self.scale_events = {role: 0 for role in ROLES}
        self.timeline: list[dict[str, float | None]] = []

    # -- the event loop ------------------------------------------------------------------

    def run(self) -> SimResult:
        for req in self.trace:
            self._push(req.t, "arrive", _Req(req))
        end = self.trace[-1].t if self.trace else 0.0
        self._push(self.interval_s, "tick", None)
        now = 0.0
        while self._events:
            now, _, kind, item = heapq.heappop(self._events)
            if kind == "tick":
                self._tick(now)
                if now < end or len(self._done) < len(self.trace):
                    self._push(now + self.interval_s, "tick", None)
            elif kind == "arrive":
                assert isinstance(item, _Req)
                self._window["arrived"].append(item)
                self._queue.append(item)
                self._feed_prefill(now)
            elif kind == "prefilled":
                self._feed_prefill(now)
            elif kind == "to_decode":
                assert isinstance(item, _Req)
                item.join_s = now
                self._waiting_decode.append(item)
                self._feed_decode(now)
            elif kind == "decode":
                replica, version = item  # type: ignore[misc]
                if version == replica.version:
                    self._decode_event(replica, now)
            elif kind == "ready":
                self._feed_prefill(now)
                self._feed_decode(now)
            elif kind == "warm":  # its steps speed up: its next completion comes sooner
                assert isinstance(item, _Replica)
                self._advance(item, now)
                self._schedule(item, now)
        return self._result(now)

    def _push(self, t: float, kind: str, item: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, item))

    # -- prefill -------------------------------------------------------------------------

    def _feed_prefill(self, now: float) -> None:
        m = self.model
        for replica in self._serving("prefill", now):
            if not self._queue:
                return
            if replica.busy_until > now:
                continue
            req = self._queue.popleft()
            cost = req.trace.uncached_tokens / (m.prefill_tokens_per_s * replica.speed(now, m))
            cost += m.prefill_overhead_s
            replica.busy_until = now + cost
            c = replica.counters
            c.busy_s += cost
            c.prefill_tokens += req.trace.uncached_tokens
            c.prefill_s += cost
            req.start_s = now
            req.first_s = now + cost
            self._window["first"].append(req)
            self._push(now + cost, "prefilled", None)
            self._push(now + cost + m.transfer_s, "to_decode", req)
        self._retire_idle(now)

    # -- decode --------------------------------------------------------------------------

    def _feed_decode(self, now: float) -> None:
        while self._waiting_decode:
            serving = [
                r for r in self._serving("decode", now) if len(r.batch) < self.model.max_batch
            ]
            if not serving:
                return
            replica = min(serving, key=lambda r: len(r.batch))
            self._advance(replica, now)
            req = self._waiting_decode.popleft()
            steps = max(req.trace.output_tokens - 1, 0)
            heapq.heappush(replica.batch, (replica.steps + steps, id(req), req))
            self._schedule(replica, now)

    def _advance(self, replica: _Replica, now: float) -> None:
        """Run ``replica``'s steps from its last update to ``now`` (its batch unchanged;
        at cold speed until it is warm)."""
        warm_s = replica.ready_s + self.model.cold_start_s
        if replica.last_s < warm_s < now:
            self._advance(replica, warm_s)
        dt = now - replica.last_s
        n = len(replica.batch)
        if n == 0 or dt <= 0:
            replica.last_s = max(replica.last_s, now)
            return
        steps = dt / self._step_s(replica, n, replica.last_s)
        replica.last_s = now
        replica.steps += steps
        c = replica.counters
        c.busy_s += dt
        c.decode_steps += steps
        c.decode_seqs += steps * n
        c.decode_s += dt

    def _step_s(self, replica: _Replica, batch: int, at: float) -> float:
        return self.model.step_s(batch) / replica.speed(at, self.model)

    def _schedule(self, replica: _Replica, now: float) -> None:
        replica.version += 1
        if replica.batch:
            left = max(replica.batch[0][0] - replica.steps, 0.0)
            t = now + left * self._step_s(replica, len(replica.batch), now)
            self._push(t, "decode", (replica, replica.version))

    def _decode_event(self, replica: _Replica, now: float) -> None:
        self._advance(replica, now)
        while replica.batch and replica.batch[0][0] <= replica.steps + 1e-9:
            _, _, req = heapq.heappop(replica.batch)
            req.done_s = now
            self._done.append(req)
            self._window["done"].append(req)
        self._schedule(replica, now)
        self._feed_decode(now)
        self._retire_idle(now)

    # -- pools ---------------------------------------------------------------------------

    def _serving(self, role: str, now: float) -> list[_Replica]:
        return [
            r for r in self.replicas
            if r.role == role and r.gone_s is None and not r.draining and r.ready_s <= now
        ]  # fmt: skip

    def _retire_idle(self, now: float) -> None:
        for r in self.replicas:
            if r.draining and r.gone_s is None and r.busy_until <= now and not r.batch:
                r.gone_s = max(now, r.busy_until)

    def _apply(self, decision: Decision, now: float) -> None:
        role, m = decision.role, self.model
        live = [r for r in self.replicas if r.role == role and r.gone_s is None and not r.draining]
        for _ in range(decision.desired - len(live)):
            replica = _Replica(role, now, now + m.startup_s, last_s=now + m.startup_s)
            self.replicas.append(replica)
            self._push(replica.ready_s, "ready", None)
            self._push(replica.ready_s + m.cold_start_s, "warm", replica)
        extra = len(live) - decision.desired
        # cancel replicas still starting first, then drain the newest serving ones
        for replica in sorted(live, key=lambda r: -r.ready_s)[: max(extra, 0)]:
            if replica.ready_s > now:
                replica.gone_s = now
            else:
                self._advance(replica, now)
                replica.draining = True
        if decision.desired != len(live):
            self.scale_events[role] += 1
        self._retire_idle(now)

    # -- the policy's view -----------------------------------------------------------------

    def _tick(self, now: float) -> None:
        obs = self._observe(now)
        for decision in self.policy.decide(obs):
            self._apply(decision, now)
        arrived, first = self._window["arrived"], self._window["first"]
        self.timeline.append({
            "t": now,
            "requests_per_s": obs.requests_per_s,
            "infeasible_per_s": sum(1 for q in arrived if not self.feasible(q)) / self.interval_s,
            "feasible_ttft_p90_s": _p90([q.ttft_s for q in first if self.feasible(q)]),
            "ttft_p90_s": obs.ttft_p90_s,
            "itl_p90_s": obs.itl_p90_s,
            **{f"{role}_replicas": float(obs.pools[role].provisioned) for role in ROLES},
        })  # fmt: skip
        self._window = {"arrived": [], "first": [], "done": []}

    def _observe(self, now: float) -> Observation:
        dt = self.interval_s
        arrived = self._window["arrived"]
        pools: dict[str, PoolState] = {}
        for role in ROLES:
            mine = [r for r in self.replicas if r.role == role and r.gone_s is None]
            pools[role] = PoolState(
                ready=sum(1 for r in mine if r.ready_s <= now and not r.draining),
                starting=sum(1 for r in mine if r.ready_s > now),
                draining=sum(1 for r in mine if r.draining),
            )
        samples = []
        for r in self.replicas:
            if r.gone_s is not None or r.ready_s > now:
                continue
            if r.role == "decode":
                self._advance(r, now)
            c = r.counters
            samples.append(WorkerSample(
                name=str(id(r)), role=r.role, age_s=now - r.ready_s, interval_s=dt,
                busy_s=c.busy_s, prefill_tokens=c.prefill_tokens, prefill_s=c.prefill_s,
                decode_tokens=round(c.decode_seqs), decode_only_steps=round(c.decode_steps),
                decode_only_seqs=round(c.decode_seqs), decode_only_s=c.decode_s,
                running=len(r.batch),
            ))  # fmt: skip
            r.counters = _Counters()
        return Observation(
            now_s=now,
            interval_s=dt,
            pools=pools,
            requests_per_s=len(arrived) / dt,
            prefill_tokens_per_s=sum(q.trace.uncached_tokens for q in arrived) / dt,
            output_tokens_per_s=sum(q.trace.output_tokens for q in arrived) / dt,
            ttft_p90_s=_p90([q.ttft_s for q in self._window["first"]]),
            itl_p90_s=_p90([q.itl_s for q in self._window["done"] if q.trace.output_tokens > 1]),
            prefill_queue_tokens=sum(q.trace.uncached_tokens for q in self._queue),
            workers=tuple(samples),
            prefill_request_tokens=Histogram.of(
                (q.trace.uncached_tokens for q in self._window["first"]), PREFILL_TOKENS_BUCKETS
            ),
            prefill_wait=Histogram.of(
                (q.start_s - q.trace.t for q in self._window["first"]), PREFILL_WAIT_BUCKETS
            ),
        )

    def target_s(self, req: _Req) -> float:
        return request_target_s(req.trace.uncached_tokens, self.targets[0], self.ttft_per_1k_s)

    def feasible(self, req: _Req) -> bool:
        """Whether its own prefill fits its TTFT target on some pool."""
        return self.model.own_prefill_s(req.trace.uncached_tokens) <= self.target_s(req)

    def _result(self, now: float) -> SimResult:
        itl_t = self.targets[1]
        done = self._done
        ok_ttft = {id(q) for q in done if q.ttft_s <= self.target_s(q)}
        ok_itl = {id(q) for q in done if q.itl_s <= itl_t}
        ok = ok_ttft & ok_itl
        feasible = [q for q in done if self.feasible(q)]
        n = max(len(self.trace), 1)
        ok_feasible = sum(1 for q in feasible if id(q) in ok) / max(len(feasible), 1)
        seconds = {role: 0.0 for role in ROLES}
        for r in self.replicas:
            start = max(r.asked_s, 0.0)
            seconds[r.role] += max((r.gone_s if r.gone_s is not None else now) - start, 0.0)
        return SimResult(len(self.trace), len(ok) / n, len(ok_ttft) / n, len(ok_itl) / n,
                         len(done) - len(feasible), ok_feasible, seconds,
                         dict(self.scale_events), self.timeline)  # fmt: skip


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(math.ceil(0.9 * len(values))) - 1)]
