"""A request's state as it moves through the engine.

Lifecycle (see docs/architecture.md §1):

    WAITING ──admit: match prefix, lock, take pages──> RUNNING (prefill chunks, then decode)
       ^                                                   │
       └──────────── preempted: pages released ────────────┤
                                                           └─> FINISHED (cache insert, unlock, free)
    AWAITING_KV (decode side of a disaggregated request: prompt pages reserved, filled by a
       KV transfer) ──activate_remote(first token)──> RUNNING

`token_ids` = prompt + output; KV exists for `token_ids[:num_computed]`, stored in
`page_ids` (one page id per `page_size` tokens, the last one possibly partial).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from radixserve.cache.radix_cache import RadixNode
from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    AWAITING_KV = "awaiting_kv"  # pages reserved; a KV transfer from a prefill worker fills them
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in page_ids
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_host_cached_tokens: int = 0  # of those, loaded from the host tier just before
    num_computed_prompt_tokens: int = 0  # prompt tokens this request actually ran through the model
    locked_node: RadixNode | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    admitted_once: bool = False
    lease_s: float | None = None  # prefill-only: hold the prompt's pages this long when done

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still without KV; 1 means a plain decode step."""
        return self.num_tokens - self.num_computed

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_time is None:
            return None
        return (self.first_token_time - self.arrival_time) * 1000.0
