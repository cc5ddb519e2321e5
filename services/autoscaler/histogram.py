"""Per-request distributions as the policy reads them: counts per bucket of a
Prometheus-style histogram (upper bounds, the last +inf).

The prefill workers export two per-request histograms (`radixserve.metrics.StatsHistogram`:
uncached prompt tokens, and the wait around a request's own compute); the metrics source
turns their change over an interval into a `Histogram`, and the simulator bins its
requests into the same buckets. The policy asks them how many observations lie above a
value and what value a quantile is, interpolating linearly within a bucket as
Prometheus's ``histogram_quantile`` does.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Histogram:
    """Observations per bucket; bucket i holds values in (bounds[i-1], bounds[i]] (the
    first from 0), and the last bound is +inf."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.counts) or not self.bounds:
            raise ValueError("a histogram needs one count per bound")
        if not math.isinf(self.bounds[-1]) or list(self.bounds) != sorted(self.bounds):
            raise ValueError("bounds must increase and end at +inf")

    @classmethod
    def of(cls, values: Iterable[float], bounds: tuple[float, ...]) -> Histogram:
        """``values`` binned under ``bounds`` (finite upper edges; +inf is added)."""
        edges = (*bounds, math.inf)
        counts = [0.0] * len(edges)
        for value in values:
            counts[bisect.bisect_left(edges, value)] += 1
        return cls(edges, tuple(counts))

    @classmethod
    def from_cumulative(cls, buckets: Mapping[float, float]) -> Histogram | None:
        """From Prometheus's cumulative ``le`` buckets (None without a +inf bucket)."""
        bounds = sorted(buckets)
        if not bounds or not math.isinf(bounds[-1]):
            return None
        below, counts = 0.0, []
        for bound in bounds:
            counts.append(max(0.0, buckets[bound] - below))
            below = max(below, buckets[bound])
        return cls(tuple(bounds), tuple(counts))

    def __add__(self, other: Histogram) -> Histogram:
        if other.bounds != self.bounds:
            raise ValueError("histograms with different buckets do not add")
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts)))

    @property
    def total(self) -> float:
        return sum(self.counts)

    def buckets(self) -> Iterator[tuple[float, float, float]]:
        """(lower, upper, count) of every non-empty bucket."""
        lower = 0.0
        for upper, count in zip(self.bounds, self.counts, strict=True):
            if count > 0:
                yield lower, upper, count
            lower = upper

    def count_above(self, x: float) -> float:
        """Observations above ``x``, spread evenly within a bucket (all of the open top
        bucket once ``x`` is past its lower edge: nothing more is known of it)."""
        above = 0.0
        for lower, upper, count in self.buckets():
            if x <= lower or math.isinf(upper):
                above += count
            elif x < upper:
                above += count * (upper - x) / (upper - lower)
        return above

    def share_above(self, x: float) -> float:
        total = self.total
        return self.count_above(x) / total if total > 0 else 0.0

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (None when empty); the open top bucket answers its lower
        edge, as Prometheus does."""
        total = self.total
        if total <= 0:
            return None
        rank, below, answer = q * total, 0.0, 0.0
        for lower, upper, count in self.buckets():
            answer = lower if math.isinf(upper) else upper
            if below + count >= rank:
                if not math.isinf(upper):
                    answer = lower + (upper - lower) * max(0.0, rank - below) / count
                break
            below += count
        return answer
