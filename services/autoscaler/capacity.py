"""What one replica can carry, learned online from the workers' own step counters.

Every interval each worker contributes a `WorkerSample` (the change of its counters,
`radixserve.engine.step_stats`). Samples of workers younger than ``cold_start_s`` are
left out: a fresh process runs its first steps slowly (allocator and kernel warm-up),
and counting them would make every scale-up look like a loss of capacity.

* **Prefill**: prompt tokens per second of prefill time, a ratio of sums over the recent
  samples (smoothed): what a replica computes when it is busy.
* **Decode**: a decode-only step of batch B takes ``t(B) = a + b * B``; least squares over
  recent (B, t) points, one per worker and interval, weighted by the steps behind each.
  At the ITL target T a replica carries ``B* = (T - a) / b`` sequences, so
  ``B* / T`` tokens per second. Until the points span two batch sizes the slope is
  unknown and the estimate is None (the policy then reacts to latency alone).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerSample:
    """One worker over one interval: changes of its counters and its current gauges."""

    name: str
    role: str
    age_s: float
    interval_s: float
    busy_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_only_steps: int = 0
    decode_only_seqs: int = 0
    decode_only_s: float = 0.0
    queued_tokens: int = 0
    running: int = 0
    lora_waiting: int = 0  # requests waiting for a LoRA adapter slot, now
    lora_max: int = 0  # its LoRA adapter slots (max_loras)

    @property
    def utilization(self) -> float:
        return min(1.0, self.busy_s / self.interval_s) if self.interval_s > 0 else 0.0


class PrefillCapacity:
    """Prompt tokens per second one busy prefill replica computes."""

    def __init__(self, cold_start_s: float, window: int = 30) -> None:
        self.cold_start_s = cold_start_s
        self._points: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, sample: WorkerSample) -> None:
        if sample.age_s < self.cold_start_s or sample.prefill_s < 0.05:
            return
        self._points.append((sample.prefill_tokens, sample.prefill_s))

    @property
    def tokens_per_s(self) -> float | None:
        seconds = sum(s for _, s in self._points)
        return sum(t for t, _ in self._points) / seconds if seconds > 0 else None


class DecodeCapacity:
    """The decode step-time model ``t(B) = a + b * B`` and what it implies at a target."""

    def __init__(self, cold_start_s: float, window: int = 200) -> None:
        self.cold_start_s = cold_start_s
        self._points: deque[tuple[float, float, int]] = deque(maxlen=window)  # (B, t, steps)

    def add(self, sample: WorkerSample) -> None:
        if sample.age_s < self.cold_start_s or sample.decode_only_steps < 3:
            return
        batch = sample.decode_only_seqs / sample.decode_only_steps
        step_s = sample.decode_only_s / sample.decode_only_steps
        self._points.append((batch, step_s, sample.decode_only_steps))

    def fit(self) -> tuple[float, float] | None:
        """(a, b) by weighted least squares, or None without two distinct batch sizes."""
        pts = list(self._points)
        total = sum(w for _, _, w in pts)
        if total == 0:
            return None
        mean_b = sum(b * w for b, _, w in pts) / total
        mean_t = sum(t * w for _, t, w in pts) / total
        var = sum(w * (b - mean_b) ** 2 for b, _, w in pts) / total
        if var < 0.25:  # the batch barely varied: the slope is not identified
            return None
        cov = sum(w * (b - mean_b) * (t - mean_t) for b, t, w in pts) / total
        slope = max(cov / var, 1e-6)
        intercept = max(mean_t - slope * mean_b, 0.0)
        return intercept, slope

    def tokens_per_s(self, itl_target_s: float) -> float | None:
        """Tokens per second one replica generates with its step time at the target."""
        model = self.fit()
        if model is None:
            return None
        intercept, slope = model
        batch = (itl_target_s - intercept) / slope
        if batch < 1:
            return 1.0 / max(intercept + slope, 1e-9)  # even one sequence misses the target
        return batch / itl_target_s
