"""The autoscaler's decision: how many prefill and decode replicas, from what it observed.

Pure logic: `ScalingPolicy.decide(observation)` gets one `Observation` per interval —
from live metrics (`metrics_source`) or from the simulator (`radixserve.bench.autoscale`)
alike — and returns one `Decision` per pool, with its inputs and a reason. Per pool:

1. **Throughput model**: ``desired = ceil(demand * correction / (capacity *
   target_utilization))``; demand (uncached prompt tokens/s for prefill, output tokens/s
   for decode) is smoothed, following rises at once and falls slowly; capacity is one
   replica's (`capacity`); the correction grows while the pool's SLO is broken and
   decays back to 1 once latency is well under.
2. **Fast step**: an SLO broken now (TTFT p90 or queued prompt tokens per replica for
   prefill, ITL p90 for decode) asks for one more replica than is provisioned, unless
   one is still starting.
3. **Scale down** one replica at a time, only while no SLO is broken, after
   ``scale_down_cooldown_s`` since the pool last changed, and only if N-1 replicas would
   run below ``scale_down_utilization`` (no 2<->1 flapping).
4. Scale-ups are ``scale_up_cooldown_s`` apart; everything stays within the bounds.

(docs/architecture.md §11.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from radixserve.services.autoscaler.capacity import DecodeCapacity, PrefillCapacity, WorkerSample
from radixserve.services.autoscaler.settings import AutoscalerSettings

ROLES = ("prefill", "decode")
Direction = Literal["up", "down", "hold"]


@dataclass(frozen=True)
class PoolState:
    """Replicas of one pool: serving, provisioned but not up yet, leaving."""

    ready: int = 0
    starting: int = 0
    draining: int = 0

    @property
    def provisioned(self) -> int:
        return self.ready + self.starting


@dataclass(frozen=True)
class Observation:
    """What the cluster did over the last interval."""

    now_s: float
    interval_s: float
    pools: dict[str, PoolState]
    requests_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0  # uncached prompt tokens arriving per second
    output_tokens_per_s: float = 0.0
    ttft_p90_s: float | None = None  # None: no request got its first token
    itl_p90_s: float | None = None
    prefill_queue_tokens: int = 0  # over the prefill workers, now
    workers: tuple[WorkerSample, ...] = ()


@dataclass(frozen=True)
class Decision:
    role: str
    current: int  # provisioned replicas
    desired: int
    direction: Direction
    reason: str  # for people: what decided it, with numbers
    inputs: dict[str, float | int | None] = field(default_factory=dict)
    kind: str = "steady"  # for metrics: throughput_model, slo_<ttft|queue|itl>, utilisation,
    # bounds, cooldown, held, steady


class _Smoothed:
    """A rate that follows rises at once and falls with time constant ``tau_s``."""

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self.value: float | None = None

    def update(self, x: float, dt: float) -> float:
        if self.value is None or x >= self.value:
            self.value = x
        else:
            self.value += (x - self.value) * (1 - math.exp(-dt / self.tau_s))
        return self.value


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
        self._demand = {role: _Smoothed(tau) for role in ROLES}
        self._memory = {role: _PoolMemory() for role in ROLES}

    def decide(self, obs: Observation) -> list[Decision]:
        for sample in obs.workers:
            if sample.role == "prefill":
                self.prefill_capacity.add(sample)
            elif sample.role == "decode":
                self.decode_capacity.add(sample)
        return [self._decide_prefill(obs), self._decide_decode(obs)]

    # -- per pool ---------------------------------------------------------------------

    def _decide_prefill(self, obs: Observation) -> Decision:
        s = self.settings
        pool = obs.pools.get("prefill", PoolState())
        demand = self._demand["prefill"].update(obs.prefill_tokens_per_s, obs.interval_s)
        capacity = self.prefill_capacity.tokens_per_s
        queue = obs.prefill_queue_tokens / max(pool.ready, 1)
        slow = obs.ttft_p90_s is not None and obs.ttft_p90_s > s.ttft_p90_target_s
        queued = pool.ready > 0 and queue > s.queue_tokens_per_replica
        breach = "ttft" if slow else "queue" if queued else ""
        if obs.ttft_p90_s is None:  # no first token: idle only if nothing waits either
            good = obs.prefill_queue_tokens == 0
        else:
            good = obs.ttft_p90_s < 0.5 * s.ttft_p90_target_s
        inputs = {
            "ttft_p90_s": obs.ttft_p90_s,
            "queue_tokens_per_replica": round(queue),
            "demand_tokens_per_s": round(demand, 1),
            "capacity_tokens_per_s": None if capacity is None else round(capacity, 1),
        }
        return self._decide("prefill", obs, pool, demand, capacity, breach, good, inputs)

    def _decide_decode(self, obs: Observation) -> Decision:
        s = self.settings
        pool = obs.pools.get("decode", PoolState())
        demand = self._demand["decode"].update(obs.output_tokens_per_s, obs.interval_s)
        capacity = self.decode_capacity.tokens_per_s(s.itl_p90_target_s)
        breach = "itl" if obs.itl_p90_s is not None and obs.itl_p90_s > s.itl_p90_target_s else ""
        good = obs.itl_p90_s is None or obs.itl_p90_s < 0.7 * s.itl_p90_target_s
        inputs = {
            "itl_p90_s": obs.itl_p90_s,
            "demand_tokens_per_s": round(demand, 1),
            "capacity_tokens_per_s": None if capacity is None else round(capacity, 1),
        }
        return self._decide("decode", obs, pool, demand, capacity, breach, good, inputs)

    def _decide(
        self,
        role: str,
        obs: Observation,
        pool: PoolState,
        demand: float,
        capacity: float | None,
        breach: str,
        good: bool,
        inputs: dict[str, float | int | None],
    ) -> Decision:
        s, mem, now = self.settings, self._memory[role], obs.now_s
        lo, hi = s.bounds(role)
        current = pool.provisioned
        if pool.starting:  # the pool is still changing: its cooldown starts once it settles
            mem.last_change_s = now
        # the correction grows while the SLO is broken, decays once latency is well under
        if breach:
            mem.correction = min(mem.correction * 1.15, 4.0)
        elif good:
            mem.correction = max(1.0, mem.correction * 0.97)
        model = None
        if capacity:
            need = demand * mem.correction / (capacity * s.target_utilization)
            model = max(math.ceil(need - 1e-9), 1 if demand > 0 else 0)
        inputs = {**inputs, "correction": round(mem.correction, 3), "model_replicas": model}
        desired, reason, kind = current, "steady", "steady"
        if model is not None and model > current:
            desired, reason, kind = model, "throughput model", "throughput_model"
        if breach and pool.starting == 0 and desired <= current:
            desired, reason, kind = current + 1, f"{breach} over target", f"slo_{breach}"
        if desired > current and now - mem.last_up_s < s.scale_up_cooldown_s:
            desired, reason, kind = current, f"{reason}, but in the scale-up cooldown", "cooldown"
        elif desired <= current and not breach and current > lo:
            desired, reason, kind = self._maybe_down(obs, pool, demand, capacity, model, good, role)
        clamped = max(lo, min(hi, desired))
        if clamped != desired or clamped != current and current < lo:
            reason, kind = f"{reason}; bounds [{lo}, {hi}]", "bounds"
        desired = clamped
        direction: Direction = (
            "up" if desired > current else "down" if desired < current else "hold"
        )
        if direction == "up":
            mem.last_up_s = mem.last_change_s = now
        elif direction == "down":
            mem.last_change_s = now
        return Decision(role, current, desired, direction, reason, inputs, kind)

    def _maybe_down(
        self,
        obs: Observation,
        pool: PoolState,
        demand: float,
        capacity: float | None,
        model: int | None,
        good: bool,
        role: str,
    ) -> tuple[int, str, str]:
        """One replica fewer if N-1 can carry the load well; else hold."""
        s, mem = self.settings, self._memory[role]
        current = pool.provisioned
        if pool.starting or not good or obs.now_s - mem.last_change_s < s.scale_down_cooldown_s:
            return current, "steady", "steady"
        if capacity:
            util = demand * mem.correction / (capacity * max(pool.ready, 1))
        else:  # no capacity estimate yet: the workers' busy time says how loaded they are
            busy = [w.utilization for w in obs.workers if w.role == role]
            util = sum(busy) / len(busy) if busy else 0.0
        after = util * current / (current - 1) if current > 1 else (0.0 if demand == 0 else 1.0)
        if after >= s.scale_down_utilization or (model is not None and model >= current):
            return current, f"held: N-1 would run at {after:.2f}", "held"
        return current - 1, f"utilisation {util:.2f} (N-1: {after:.2f})", "utilisation"
