"""Demand as the policy measures it: over enough recent requests, then smoothed.

A pool's demand (uncached prompt tokens/s, output tokens/s) is a rate over the trailing
intervals that hold enough requests for a stable mean (`RequestWindow`; the policy sizes
it from how much the requests' lengths vary), followed at once when it rises and slowly
when it falls (`SmoothedRate`), so a burst is met at once and a lull is not taken for
the end of the day.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class RequestWindow(Generic[T]):
    """The trailing intervals that hold ``requests`` requests: at least the last one, at
    most ``span_s``. With long-tailed prompts an interval's few dozen requests are
    dominated by the longest among them; a few hundred requests are not."""

    def __init__(self, requests: int, span_s: float) -> None:
        self.requests, self.span_s = requests, span_s
        self._recent: deque[tuple[float, float, T]] = deque()  # (dt, requests, item)

    def add(self, dt: float, requests: float, item: T) -> list[T]:
        """Record an interval; the items of the window, oldest first."""
        self._recent.append((dt, requests, item))
        span = sum(d for d, _, _ in self._recent)
        count = sum(n for _, n, _ in self._recent)
        while len(self._recent) > 1:
            oldest_dt, oldest_n, _ = self._recent[0]
            if span - oldest_dt < self.span_s and count - oldest_n < self.requests:
                break  # without the oldest interval the window would hold too few
            self._recent.popleft()
            span, count = span - oldest_dt, count - oldest_n
        return [item for _, _, item in self._recent]

    @property
    def span(self) -> float:
        return sum(d for d, _, _ in self._recent)


class SmoothedRate:
    """A rate measured over a `RequestWindow`, then followed at once when it rises and with
    time constant ``tau_s`` when it falls."""

    def __init__(self, tau_s: float, window: RequestWindow[float]) -> None:
        self.tau_s, self.window = tau_s, window
        self.value: float | None = None

    def update(self, rate: float, dt: float, requests: float) -> float:
        x = sum(self.window.add(dt, requests, rate * dt)) / max(self.window.span, 1e-9)
        if self.value is None or x >= self.value:
            self.value = x
        else:
            self.value += (x - self.value) * (1 - math.exp(-dt / self.tau_s))
        return self.value
