"""The autoscaler's decision: how many prefill and decode replicas, from what it observed.

Pure logic: `ScalingPolicy.decide(observation)` gets one `Observation` per interval —
from live metrics (`metrics_source`) or from the simulator (`radixserve.bench.autoscale`)
alike — and returns one `Decision` per pool, with its inputs and a reason. Per pool:

1. **Throughput model**: ``desired = ceil(demand * correction / (capacity *
   target_utilization))``; demand (uncached prompt tokens/s for prefill, output tokens/s
   for decode) is smoothed, following rises at once and falls slowly; capacity is one
   replica's (`capacity`); the correction grows while the pool's SLO is broken in a way
   replicas can fix and decays back to 1 once latency is well under. Capacity is
   measured from the workers' own step counters, so whatever makes steps slower —
   LoRA adapters' updates in a batch among them — lowers it by itself, with no model of
   its own.
2. **Only what replicas can fix** (`feasibility`): a request whose own work exceeds its
   target (a prompt longer than a replica computes within the TTFT target, a decode step
   of one sequence over the ITL target) is infeasible: counted, reported, never scaled
   for. Prefill scales on the feasible requests that waiting made late and on queue
   depth, not on raw TTFT; decode on ITL only while one sequence alone meets its target.
3. **Fast step**: such a breach asks for one more replica than is provisioned, unless
   one is still starting.
4. **Cost**: replicas past what the throughput model needs at correction 1 are added
   only while each is predicted to take at least ``scale_up_min_gain`` of the target off
   the measured queueing delay (`queueing`); a ceiling on replica-seconds per interval
   caps both pools together.
5. **Scale down** one replica at a time, only while no SLO is broken, after
   ``scale_down_cooldown_s`` since the pool last changed, and only if N-1 replicas would
   run below ``scale_down_utilization`` (no 2<->1 flapping).
6. **LoRA adapter slots**: a replica runs at most ``max_loras`` distinct adapters at
   once, and a request of another adapter waits for a slot however idle the replica
   is (`radixserve.engine.scheduler`). While any of a pool's requests wait so (its
   workers' ``lora_waiting_requests``, summed), the pool gets one replica more than
   provisioned whatever the token rate, unless one is still starting, and never one
   fewer: one step per scale-up cooldown until none waits. Not ``ceil(distinct
   adapters in demand / max_loras)``: the adapters in demand are not observable from
   the workers' series (each reports its own slots; an adapter waiting on two workers
   would count twice), and a new replica takes its share of the adapters only as the
   gateway's routing spreads requests to it.
7. Scale-ups are ``scale_up_cooldown_s`` apart; everything stays within the bounds.

(docs/architecture.md §11.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from radixserve.services.autoscaler.capacity import DecodeCapacity, PrefillCapacity
from radixserve.services.autoscaler.demand import RequestWindow, SmoothedRate
from radixserve.services.autoscaler.feasibility import (
    InfeasibleShare,
    PrefillSplit,
    itl_advice,
    itl_own_s,
    predicted_late_share,
    prefill_split,
    service_moments,
    ttft_advice,
)
from radixserve.services.autoscaler.histogram import Histogram
from radixserve.services.autoscaler.observation import (
    ROLES,
    Decision,
    Direction,
    Observation,
    PoolState,
)
from radixserve.services.autoscaler.queueing import mean_wait_s, next_replica_gain
from radixserve.services.autoscaler.settings import AutoscalerSettings

SLO_QUANTILE = 0.9  # the targets are p90s: a tenth of the requests may miss
ADVICE_WINDOW_S = 300.0  # the infeasible share behind the advice is over this long
PLANNED_LATE_SHARE = 0.05  # the queueing model sizes prefill for this late share at most


@dataclass(frozen=True)
class _Signals:
    """One pool's view of the interval, as `_decide` weighs it."""

    demand: float
    capacity: float | None
    need: Callable[[float], int] | None  # replicas a demand needs (None: capacity unknown)
    breach: str  # "" or what is over target and replicas can fix
    good: bool  # latency well under target: the correction may decay, the pool shrink
    # delay one more replica past n takes off, at the load times the correction
    gain_s: Callable[[float, int], float] | None
    gain_floor_s: float  # ... below which it is not worth its cost
    inputs: dict[str, float | int | None]
    lora_waiting: int = 0  # requests waiting for a LoRA adapter slot, over the pool
    lora_max: int = 0  # a replica's adapter slots (0: not reported)


@dataclass
class _PoolMemory:
    last_up_s: float = -math.inf
    last_change_s: float = -math.inf
    correction: float = 1.0


class ScalingPolicy:
    """Decides replica counts; holds the learned capacities, smoothed demand and timers."""

    def __init__(self, settings: AutoscalerSettings) -> None:
        self.settings = settings
        self.prefill_capacity = PrefillCapacity(settings.cold_start_s)
        self.decode_capacity = DecodeCapacity(settings.cold_start_s)
        tau = max(4 * settings.interval_s, settings.scale_down_cooldown_s / 2)
        span = max(settings.interval_s, settings.scale_down_cooldown_s)
        count = self._window_requests(None)
        self._demand = {role: SmoothedRate(tau, RequestWindow(count, span)) for role in ROLES}
        # the prefill requests' uncached tokens (None: not exported) over the same window
        self._recent_tokens: RequestWindow[Histogram | None] = RequestWindow(count, span)
        self._memory = {role: _PoolMemory() for role in ROLES}
        self._infeasible = {role: InfeasibleShare(ADVICE_WINDOW_S) for role in ROLES}

    def decide(self, obs: Observation) -> list[Decision]:
        for sample in obs.workers:
            if sample.role == "prefill":
                self.prefill_capacity.add(sample)
            elif sample.role == "decode":
                self.decode_capacity.add(sample)
        recent = self._recent_histogram(obs)
        count = self._window_requests(recent)
        for window in (self._recent_tokens, *(d.window for d in self._demand.values())):
            window.requests = count
        room = self.settings.max_replicas
        decode_now = obs.pools.get("decode", PoolState()).provisioned
        prefill = self._decide_prefill(obs, recent, None if room is None else room - decode_now)
        decode = self._decide_decode(obs, None if room is None else room - prefill.desired)
        return [prefill, decode]

    def _window_requests(self, recent: Histogram | None) -> int:
        """Requests the demand is measured over: enough that its relative error — about
        ``sqrt((1 + cv²) / n)`` for n requests arriving at random whose uncached tokens
        have squared coefficient of variation cv² (1 until it is known) — is
        ``demand_relative_error``. Long-tailed prompts need hundreds, chat a few dozen."""
        moments = None if recent is None else service_moments(recent, 1.0)
        cv2 = 1.0 if moments is None else moments[1]
        return math.ceil((1.0 + cv2) / self.settings.demand_relative_error**2)

    # -- per pool ---------------------------------------------------------------------

    def _decide_prefill(
        self, obs: Observation, recent: Histogram | None, room: int | None
    ) -> Decision:
        s = self.settings
        pool = obs.pools.get("prefill", PoolState())
        requests = obs.requests_per_s * obs.interval_s
        demand = self._demand["prefill"].update(obs.prefill_tokens_per_s, obs.interval_s, requests)
        capacity = self.prefill_capacity.tokens_per_s
        split = None
        if obs.prefill_request_tokens is not None and obs.prefill_wait is not None:
            split = prefill_split(obs.prefill_request_tokens, obs.prefill_wait, capacity,
                                  s.ttft_p90_target_s, s.ttft_per_1k_tokens_s)  # fmt: skip
        signals = self._prefill_signals(obs, pool, demand, capacity, split, recent)
        decision = self._decide("prefill", obs, pool, signals, room)
        if split is None:
            return decision
        window = self._sizeable("prefill", obs, split.infeasible, split.requests)
        advice = ""
        if window is not None and capacity:
            advice = ttft_advice(*window, ADVICE_WINDOW_S, capacity, split.threshold_tokens,
                                 s.ttft_p90_target_s)  # fmt: skip
        return replace(decision, infeasible=split.infeasible, advice=advice)

    def _prefill_signals(
        self,
        obs: Observation,
        pool: PoolState,
        demand: float,
        capacity: float | None,
        split: PrefillSplit | None,
        recent: Histogram | None,
    ) -> _Signals:
        """Breach on the feasible requests' queueing and on queue depth; the sizing of
        the throughput and queueing models; the gain of one more replica."""
        s = self.settings
        queue = obs.prefill_queue_tokens / max(pool.ready, 1)
        queued = pool.ready > 0 and queue > s.queue_tokens_per_replica
        slow, good, delay = self._prefill_latency(obs, split)
        if queued and capacity:  # a new prompt waits for the queue ahead of it
            delay = max(delay, queue / capacity)
        breach = (
            ("queue_wait" if split is not None else "ttft") if slow else "queue" if queued else ""
        )
        inputs: dict[str, float | int | None] = {
            "ttft_p90_s": obs.ttft_p90_s,
            "queue_tokens_per_replica": round(queue),
            "demand_tokens_per_s": round(demand, 1),
            "capacity_tokens_per_s": None if capacity is None else round(capacity, 1),
        }
        if split is not None:
            inputs.update(_split_inputs(split))
        need = gain = None
        if capacity:
            need = partial(self._prefill_need, rate=capacity, recent=recent)
            moments = None if recent is None else service_moments(recent, capacity)
            backlog_s = obs.prefill_queue_tokens / capacity
            gain = partial(_prefill_gain, moments, demand / capacity, backlog_s, delay)
        floor = s.scale_up_min_gain * s.ttft_p90_target_s
        return _Signals(demand, capacity, need, breach, good, gain, floor, inputs,
                        *_lora_slots(obs, "prefill", inputs))  # fmt: skip

    def _prefill_latency(
        self, obs: Observation, split: PrefillSplit | None
    ) -> tuple[bool, bool, float]:
        """(SLO broken in a way replicas fix, latency well under target, queueing delay)."""
        target = self.settings.ttft_p90_target_s
        if split is None:  # no per-request histograms: raw TTFT, as without the workers' split
            if obs.ttft_p90_s is None:  # no first token: idle only if nothing waits either
                return False, obs.prefill_queue_tokens == 0, 0.0
            return obs.ttft_p90_s > target, obs.ttft_p90_s < 0.5 * target, obs.ttft_p90_s
        if split.requests <= 0:
            return False, obs.prefill_queue_tokens == 0, 0.0
        late = split.late_share
        wait = split.wait_p90_s or 0.0
        slow = late is not None and late > 1 - SLO_QUANTILE
        good = (late is None or late <= (1 - SLO_QUANTILE) / 4) and wait < 0.5 * target
        return slow, good, wait

    def _decide_decode(self, obs: Observation, room: int | None) -> Decision:
        s = self.settings
        pool = obs.pools.get("decode", PoolState())
        requests = obs.requests_per_s * obs.interval_s
        demand = self._demand["decode"].update(obs.output_tokens_per_s, obs.interval_s, requests)
        fit = self.decode_capacity.fit()
        own = itl_own_s(fit)
        feasible = own is None or own <= s.itl_p90_target_s
        # infeasible: plan where load adds no more than a step's own time
        plan_s = s.itl_p90_target_s if own is None or feasible else 2 * own
        capacity = self.decode_capacity.tokens_per_s(plan_s)
        itl = obs.itl_p90_s
        breach = "itl" if feasible and itl is not None and itl > s.itl_p90_target_s else ""
        good = itl is None or itl < 0.7 * plan_s
        running = sum(w.running for w in obs.workers if w.role == "decode")
        inputs: dict[str, float | int | None] = {
            "itl_p90_s": itl,
            "itl_own_s": None if own is None else round(own, 5),
            "demand_tokens_per_s": round(demand, 1),
            "capacity_tokens_per_s": None if capacity is None else round(capacity, 1),
        }
        need = None if not capacity else partial(_throughput_need, capacity * s.target_utilization)
        gain = None if fit is None else partial(_decode_gain, fit[1] * running)
        signals = _Signals(demand, capacity, need, breach, good, gain,
                           s.scale_up_min_gain * s.itl_p90_target_s, inputs,
                           *_lora_slots(obs, "decode", inputs))  # fmt: skip
        decision = self._decide("decode", obs, pool, signals, room)
        infeasible = 0.0 if feasible else requests  # every request that finished
        window = self._sizeable("decode", obs, infeasible, requests)
        advice = itl_advice(own, s.itl_p90_target_s) if window and own is not None else ""
        return replace(decision, infeasible=infeasible, advice=advice)

    def _recent_histogram(self, obs: Observation) -> Histogram | None:
        """The prefill requests' uncached tokens over the demand window (this interval's
        included)."""
        tokens = obs.prefill_request_tokens
        items = self._recent_tokens.add(obs.interval_s, tokens.total if tokens else 0.0, tokens)
        recent = [h for h in items if isinstance(h, Histogram)]
        return sum(recent[1:], recent[0]) if recent else None

    def _prefill_need(self, demand: float, rate: float, recent: Histogram | None) -> int:
        """Prefill replicas ``demand`` needs: the throughput model's, or more where the
        queueing model says that many would make over `PLANNED_LATE_SHARE` of the
        feasible requests late (long prompts queue longer at the same utilisation)."""
        s = self.settings
        need = _throughput_need(rate * s.target_utilization, demand)
        if recent is None or demand <= 0:
            return need
        load = demand / rate
        for servers in range(max(need, 1), s.max_prefill + 1):
            late = predicted_late_share(recent, rate, s.ttft_p90_target_s,
                                        s.ttft_per_1k_tokens_s, servers, load)  # fmt: skip
            if late <= PLANNED_LATE_SHARE:
                return servers
        return max(need, s.max_prefill)

    def _sizeable(
        self, role: str, obs: Observation, infeasible: float, requests: float
    ) -> tuple[float, float] | None:
        """Record the interval; (infeasible, requests) over the window while the
        infeasible share is sizeable, else None."""
        bad, total = self._infeasible[role].add(obs.now_s, infeasible, requests)
        if total > 0 and bad / total >= self.settings.infeasible_advice_share:
            return bad, total
        return None

    # -- the decision common to both pools ------------------------------------------------

    def _decide(
        self, role: str, obs: Observation, pool: PoolState, sig: _Signals, room: int | None
    ) -> Decision:
        s, mem, now = self.settings, self._memory[role], obs.now_s
        lo, hi = s.bounds(role)
        current = pool.provisioned
        # the pool is still changing, or first seen: its cooldown starts once it settles
        if pool.starting or mem.last_change_s == -math.inf:
            mem.last_change_s = now
        # the correction grows while the SLO is broken, decays once latency is well under:
        # the models then see more load than measured (their error), and where a breach
        # lasts that replicas could not fix, they still find no replica worth adding
        if sig.breach:
            mem.correction = min(mem.correction * 1.15, 4.0)
        elif sig.good:
            mem.correction = max(1.0, mem.correction * 0.97)
        base = model = None
        if sig.need is not None:
            base = sig.need(sig.demand)
            model = max(sig.need(sig.demand * mem.correction), base)
        inputs = {**sig.inputs, "correction": round(mem.correction, 3), "model_replicas": model}
        desired, reason, kind = current, "steady", "steady"
        if model is not None and model > current:
            desired, reason, kind = model, "throughput and queueing model", "throughput_model"
            if sig.breach and base is not None and base <= current:  # the correction did it
                reason, kind = f"{sig.breach} over target", f"slo_{sig.breach}"
        if sig.breach and pool.starting == 0 and desired <= current:
            desired, reason, kind = current + 1, f"{sig.breach} over target", f"slo_{sig.breach}"
        why = (reason, kind)
        desired, reason, kind = self._worth_it(desired, current, base, sig, mem.correction, why)
        # requests wait for an adapter slot: a floor past the cost check (module notes, 6)
        if sig.lora_waiting and pool.starting == 0 and desired <= current:
            desired, kind = current + 1, "lora_slots"
            reason = (f"{sig.lora_waiting} requests wait for a LoRA adapter slot "
                      f"({sig.lora_max or '?'} per replica)")  # fmt: skip
        if desired > current and now - mem.last_up_s < s.scale_up_cooldown_s:
            desired, reason, kind = current, f"{reason}, but in the scale-up cooldown", "cooldown"
        elif desired <= current and not sig.breach and not sig.lora_waiting and current > lo:
            desired, reason, kind = self._maybe_down(obs, pool, sig, model, role)
        clamped = max(lo, min(hi, desired))
        if clamped != desired or clamped != current and current < lo:
            reason, kind = f"{reason}; bounds [{lo}, {hi}]", "bounds"
        if room is not None and clamped > max(current, room):
            clamped = max(current, room, lo)
            reason, kind = f"{reason}; replica-seconds ceiling", "ceiling"
        desired = clamped
        direction: Direction = (
            "up" if desired > current else "down" if desired < current else "hold"
        )
        if direction == "up":
            mem.last_up_s = mem.last_change_s = now
        elif direction == "down":
            mem.last_change_s = now
        return Decision(role, current, desired, direction, reason, inputs, kind)

    def _worth_it(
        self, desired: int, current: int, base: int | None, sig: _Signals, correction: float,
        why: tuple[str, str],
    ) -> tuple[int, str, str]:  # fmt: skip
        """``desired`` cut to the replicas worth their cost: past the throughput model's
        need, each must take at least ``gain_floor_s`` off the queueing delay."""
        start = max(current, base or 0)
        if desired <= start or sig.gain_s is None:
            return desired, *why
        n = start
        while n < desired and sig.gain_s(correction, n) >= sig.gain_floor_s:
            n += 1
        if n == desired:
            return desired, *why
        gain = sig.gain_s(correction, n)
        why_not = (f"diminishing returns: a replica past {n} takes {gain:.3g} s off the "
                   f"queueing delay (< {sig.gain_floor_s:.3g} s)")  # fmt: skip
        return n, why_not, "diminishing_returns"

    def _maybe_down(
        self, obs: Observation, pool: PoolState, sig: _Signals, model: int | None, role: str
    ) -> tuple[int, str, str]:
        """One replica fewer if N-1 can carry the load well; else hold."""
        s, mem = self.settings, self._memory[role]
        current = pool.provisioned
        if pool.starting or not sig.good or obs.now_s - mem.last_change_s < s.scale_down_cooldown_s:
            return current, "steady", "steady"
        if sig.capacity:
            util = sig.demand * mem.correction / (sig.capacity * max(pool.ready, 1))
        else:  # no capacity estimate yet: the workers' busy time says how loaded they are
            busy = [w.utilization for w in obs.workers if w.role == role]
            util = sum(busy) / len(busy) if busy else 0.0
        demand = sig.demand
        after = util * current / (current - 1) if current > 1 else (0.0 if demand == 0 else 1.0)
        if after >= s.scale_down_utilization or (model is not None and model >= current):
            return current, f"held: N-1 would run at {after:.2f}", "held"
        return current - 1, f"utilisation {util:.2f} (N-1: {after:.2f})", "utilisation"


def _lora_slots(
    obs: Observation, role: str, inputs: dict[str, float | int | None]
) -> tuple[int, int]:
    """(requests waiting for a LoRA adapter slot over the ``role`` pool, a replica's
    slots), noted in ``inputs`` while any wait."""
    mine = [w for w in obs.workers if w.role == role]
    waiting = sum(w.lora_waiting for w in mine)
    slots = max((w.lora_max for w in mine), default=0)
    if waiting:
        inputs["lora_waiting_requests"] = waiting
    return waiting, slots


def _throughput_need(per_replica: float, demand: float) -> int:
    """Replicas that carry ``demand`` at ``per_replica`` each (at least one for any)."""
    return max(math.ceil(demand / per_replica - 1e-9), 1 if demand > 0 else 0)


def _prefill_gain(
    moments: tuple[float, float] | None, load: float, backlog_s: float, delay_s: float,
    correction: float, servers: int,
) -> float:  # fmt: skip
    """Queueing delay the replica past ``servers`` is predicted to take off: the queueing
    model's mean wait at ``servers`` less that at one more (``moments``: the service
    times; without them, that ratio of the measured ``delay_s``), or its share of the
    backlog queued now (``backlog_s`` of one replica's compute), whichever is more."""
    if servers <= 0:
        return math.inf
    load *= correction
    backlog = backlog_s * (1 / servers - 1 / (servers + 1))
    if moments is None:
        return max(next_replica_gain(delay_s, servers, load), backlog)
    now = mean_wait_s(servers, load, *moments)
    if math.isinf(now):
        return math.inf
    return max(now - mean_wait_s(servers + 1, load, *moments), backlog)


def _decode_gain(load_part_s: float, correction: float, servers: int) -> float:
    """A decode step's load part ``b·B`` shrinks by this with one more replica."""
    if servers <= 0:
        return math.inf
    return load_part_s * correction * (1 / servers - 1 / (servers + 1))


def _split_inputs(split: PrefillSplit) -> dict[str, float | int | None]:
    late = split.late_share
    return {
        "first_tokens": round(split.requests),
        "infeasible": round(split.infeasible, 1),
        "late_share": None if late is None else round(late, 4),
        "wait_p90_s": None if split.wait_p90_s is None else round(split.wait_p90_s, 4),
        "infeasible_over_tokens": (
            None if math.isinf(split.threshold_tokens) else round(split.threshold_tokens)
        ),
    }
