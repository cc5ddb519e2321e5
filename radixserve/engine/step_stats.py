"""Counters of the engine's steps: what a worker's capacity is, measured as it serves.

The autoscaler (`radixserve.services.autoscaler`) reads them from every worker's
heartbeat to learn, online, how many prompt tokens per second a prefill worker computes
and how a decode worker's step time grows with its batch. A step's time is split between
its prefill chunks and its decodes in proportion to their tokens; steps that only decode
are also counted on their own, since their time is the inter-token latency at that batch
size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepStats:
    """Running totals since the engine started (engine thread writes, others read)."""

    engine_steps_total: int = 0
    engine_busy_seconds_total: float = 0.0
    engine_prefill_tokens_total: int = 0  # prompt tokens run through the model
    engine_prefill_seconds_total: float = 0.0  # their share of step time
    engine_decode_tokens_total: int = 0  # one per decoding sequence per step
    engine_decode_seconds_total: float = 0.0
    engine_decode_only_steps_total: int = 0
    engine_decode_only_seqs_total: int = 0  # sum of batch sizes of decode-only steps
    engine_decode_only_seconds_total: float = 0.0
    queued_prompt_tokens: int = 0  # prompt tokens of unfinished prefills, after the step
    cpu_threads: int = 0  # torch's threads in the last step (0: not set by the engine)

    def record(self, num_new_tokens: list[int], seconds: float) -> None:
        """Count one step whose requests computed ``num_new_tokens`` in ``seconds``."""
        decodes = sum(1 for n in num_new_tokens if n == 1)
        prefill = sum(n for n in num_new_tokens if n > 1)
        total = decodes + prefill
        self.engine_steps_total += 1
        self.engine_busy_seconds_total += seconds
        if total == 0:
            return
        self.engine_prefill_tokens_total += prefill
        self.engine_prefill_seconds_total += seconds * prefill / total
        self.engine_decode_tokens_total += decodes
        self.engine_decode_seconds_total += seconds * decodes / total
        if prefill == 0:
            self.engine_decode_only_steps_total += 1
            self.engine_decode_only_seqs_total += decodes
            self.engine_decode_only_seconds_total += seconds

    def as_dict(self) -> dict[str, int | float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}
