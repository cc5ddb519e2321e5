"""What the autoscaler's policy is given each interval and what it answers: the replicas
of each pool (`PoolState`), what the cluster did (`Observation`: from live metrics,
`metrics_source`, or from the simulator alike) and one `Decision` per pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from radixserve.services.autoscaler.capacity import WorkerSample
from radixserve.services.autoscaler.histogram import Histogram

ROLES = ("prefill", "decode")
SLO_OF = {"prefill": "ttft", "decode": "itl"}
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
    # the prefill workers' requests that got a first token: their uncached prompt tokens
    # and the wait around their own compute (None: no prefill worker exports them)
    prefill_request_tokens: Histogram | None = None
    prefill_wait: Histogram | None = None


@dataclass(frozen=True)
class Decision:
    role: str
    current: int  # provisioned replicas
    desired: int
    direction: Direction
    reason: str  # for people: what decided it, with numbers
    inputs: dict[str, float | int | None] = field(default_factory=dict)
    kind: str = "steady"  # for metrics: throughput_model, slo_<queue_wait|queue|ttft|itl>,
    # lora_slots, diminishing_returns, ceiling, utilisation, bounds, cooldown, held, steady
    infeasible: float = 0.0  # requests of the interval no number of replicas serves in time
    advice: str = ""  # while a sizeable share is infeasible: what to do instead of scaling
