"""Which SLO misses replicas can fix: a request's latency split into its own work and
the wait that load adds to it.

**TTFT.** A request's own compute is its uncached prompt tokens at the measured
per-replica prefill rate; its target is the TTFT target or, with a per-token budget
(``ttft_per_1k_tokens_s``), ``max(target, budget × tokens / 1000)``. A request whose own
compute exceeds its target is *infeasible*: no number of replicas serves it in time, so
it is counted and reported, never scaled for. The rest of its time to first token is
the wait (queueing, transfer) — what replicas can shorten. The prefill workers export
both per request (`radixserve.metrics.StatsHistogram`: uncached tokens, and the wait
around a request's own compute); `prefill_split` tells from them how many requests were
infeasible and what share of the feasible ones the waits made late, treating the wait
as independent of the request's size (a worker serves its queue in arrival order).

**ITL.** A decode step of one sequence takes ``t(1) = a + b`` (the step-time model of
`capacity.DecodeCapacity`): a request's inter-token latency with no load at all. When
that is over the ITL target every request is infeasible for ITL, and more decode
replicas only add cost; otherwise what is over ``t(1)`` is load, which replicas fix.
(The decode workers' step counters carry no per-request context lengths, so a request's
own part is one sequence's step at the pool's typical lengths, not its own length's.)

When a sizeable share of requests is infeasible over the last minutes, the policy says
so and names what the cluster offers instead of replicas (`REMEDIES`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from radixserve.services.autoscaler.histogram import Histogram
from radixserve.services.autoscaler.queueing import wait_survival

#: what the cluster offers when requests are infeasible, per SLO: (name, what it does)
REMEDIES: dict[str, tuple[tuple[str, str], ...]] = {
    "ttft": (
        ("prefill_tp", "a larger tensor-parallel group per prefill worker (radixserve up "
         "--prefill-tp N, RADIXSERVE_PREFILL_TP) computes each prompt on N devices"),
        ("per_token_slo", "a per-token TTFT budget for long prompts "
         "(RADIXSERVE_AUTOSCALER_TTFT_PER_1K_TOKENS_S), as SLOs for long contexts are written"),
        ("chunked_prefill_priority", "chunked-prefill priorities (RADIXSERVE_PREFILL_CHUNK_"
         "TOKENS: a smaller chunk lets short prompts pass long ones on a worker)"),
    ),
    "itl": (
        ("decode_tp", "a larger tensor-parallel group per decode worker (radixserve up "
         "--decode-tp N, RADIXSERVE_DECODE_TP) shortens every step"),
        ("itl_target", "an ITL target above one sequence's step time "
         "(RADIXSERVE_AUTOSCALER_ITL_P90_TARGET_S)"),
    ),
}  # fmt: skip
SUBPOINTS = 4  # points per token bucket at which a request's slack is evaluated


@dataclass(frozen=True)
class PrefillSplit:
    """One interval's requests that got a first token from the prefill pool."""

    requests: float
    infeasible: float
    late_share: float | None  # of the feasible ones, the share the waits made late
    wait_p90_s: float | None  # the wait around a request's own compute, p90
    threshold_tokens: float  # uncached tokens past which a request is infeasible (inf: none)


def request_target_s(tokens: float, target_s: float, per_1k_s: float | None) -> float:
    """A request's TTFT target: the p90 target, or its per-token budget if larger."""
    return target_s if per_1k_s is None else max(target_s, per_1k_s * tokens / 1000.0)


def infeasible_threshold(rate: float | None, target_s: float, per_1k_s: float | None) -> float:
    """Uncached tokens past which a request's own compute exceeds its target at ``rate``
    tokens/s (inf: every request fits, or the rate is not known yet)."""
    if rate is None or rate <= 0:
        return math.inf
    if per_1k_s is not None and per_1k_s * rate >= 1000.0:
        return math.inf  # the budget grows at least as fast as the compute
    return rate * target_s


def prefill_split(
    tokens: Histogram,
    waits: Histogram,
    rate: float | None,
    target_s: float,
    per_1k_s: float | None,
) -> PrefillSplit:
    """Infeasible requests and the feasible ones' late share, from the per-request
    uncached tokens and waits of an interval."""
    threshold = infeasible_threshold(rate, target_s, per_1k_s)
    late = n = 0.0
    for weight, _, slack in feasible_slacks(tokens, rate, target_s, per_1k_s):
        late += weight * waits.share_above(slack)
        n += weight
    return PrefillSplit(
        requests=tokens.total,
        infeasible=tokens.count_above(threshold),
        late_share=late / n if n > 1e-9 else None,
        wait_p90_s=waits.quantile(0.9),
        threshold_tokens=threshold,
    )


def feasible_slacks(
    tokens: Histogram, rate: float | None, target_s: float, per_1k_s: float | None
) -> Iterator[tuple[float, float, float]]:
    """(weight, uncached tokens, slack: target less own compute) over the feasible
    requests of ``tokens``, a few points per bucket (weights sum to their count)."""
    threshold = infeasible_threshold(rate, target_s, per_1k_s)
    for lower, upper, count in tokens.buckets():
        top = min(upper, threshold)
        if top <= lower:
            continue
        part = count if math.isinf(upper) else count * (top - lower) / (upper - lower)
        for k in range(SUBPOINTS):
            at = lower if math.isinf(top) else lower + (top - lower) * (k + 0.5) / SUBPOINTS
            own = at / rate if rate else 0.0
            yield part / SUBPOINTS, at, request_target_s(at, target_s, per_1k_s) - own


def predicted_late_share(
    tokens: Histogram, rate: float, target_s: float, per_1k_s: float | None,
    servers: int, load: float,
) -> float:  # fmt: skip
    """The share of feasible requests a pool of ``servers`` replicas offered ``load``
    (replicas' worth of work) would make late, by the queueing model
    (`queueing.wait_survival`) over the service times ``tokens`` imply at ``rate``."""
    moments = service_moments(tokens, rate)
    if moments is None:
        return 0.0
    late = n = 0.0
    for weight, _, slack in feasible_slacks(tokens, rate, target_s, per_1k_s):
        late += weight * wait_survival(servers, load, *moments, slack)
        n += weight
    return late / n if n > 1e-9 else 0.0


def service_moments(tokens: Histogram, rate: float) -> tuple[float, float] | None:
    """(mean service time, its squared coefficient of variation) of requests of
    ``tokens`` at ``rate`` tokens/s, from the bucket midpoints (None: no request)."""
    total = tokens.total
    if total <= 0 or rate <= 0:
        return None
    mids = [(count, lower if math.isinf(upper) else (lower + upper) / 2)
            for lower, upper, count in tokens.buckets()]  # fmt: skip
    mean = sum(c * m for c, m in mids) / total
    square = sum(c * m * m for c, m in mids) / total
    return mean / rate, max(0.0, square / mean**2 - 1.0) if mean > 0 else 0.0


def itl_own_s(fit: tuple[float, float] | None) -> float | None:
    """A request's inter-token latency with no load: one sequence's step time."""
    return None if fit is None else fit[0] + fit[1]


class InfeasibleShare:
    """Infeasible requests over the trailing ``window_s``: the share behind the advice."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._points: deque[tuple[float, float, float]] = deque()  # (t, infeasible, requests)

    def add(self, now_s: float, infeasible: float, requests: float) -> tuple[float, float]:
        """Record an interval; returns (infeasible, requests) over the window."""
        self._points.append((now_s, infeasible, requests))
        while self._points and self._points[0][0] <= now_s - self.window_s:
            self._points.popleft()
        return sum(p[1] for p in self._points), sum(p[2] for p in self._points)


def ttft_advice(infeasible: float, requests: float, window_s: float, rate: float,
                threshold_tokens: float, target_s: float) -> str:  # fmt: skip
    """What to tell an operator when a sizeable share cannot meet the TTFT target."""
    budget = 1.25 * 1000.0 / rate  # a per-token budget every request fits, with headroom
    return (
        f"{infeasible:.0f} of {requests:.0f} requests ({infeasible / requests:.0%}) in the "
        f"last {window_s:g} s cannot meet the {target_s:g} s TTFT target on any number of "
        f"replicas: their uncached prompt tokens are more than the {threshold_tokens:,.0f} a "
        f"replica computes in that time (measured: {rate:,.0f} tokens/s). Not scaling for "
        "them. "
        f"Remedies: {_remedies('ttft')} (at this rate {budget:.3g} s per 1k tokens fits "
        "every request)."
    )


def itl_advice(own_s: float, target_s: float) -> str:
    """What to tell an operator when one sequence's step alone misses the ITL target."""
    return (
        f"one sequence's decode step alone takes {own_s * 1000:.1f} ms, over the "
        f"{target_s * 1000:g} ms ITL target: no number of decode replicas meets it. Not "
        f"scaling for it. Remedies: {_remedies('itl')}."
    )


def _remedies(slo: str) -> str:
    return "; ".join(text for _, text in REMEDIES[slo])
