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

A request with ``n`` choices is a group: the first member (choice 0, internal id = the
request id) computes the prompt; when it samples its first token it forks into n
members that share the prompt's pages (`Scheduler.fork`), each with its own output.

A request's pages are cached in its ``namespace``: the engine's own for the default
scope (""), else the one its ``cache_scope`` names (`radixserve.cache.block_hash`), so it
matches only pages computed under the same scope (`radixserve.cache.radix_tree`). A
request with a LoRA ``adapter`` has a namespace of that adapter's (its fingerprint in the
model identity): it never shares pages with the base model or another adapter.

Its ``tenant``, ``priority`` and ``weight`` (`radixserve.engine.fair_share.TenantShare`)
decide, with other tenants' requests, when it is admitted and how many prefill tokens it
gets in a step (`radixserve.engine.scheduler`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.outputs import TokenLogprob
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.thinking_budget import ThinkingBudget
from radixserve.protocol.cached_tokens import CachedTokens

if TYPE_CHECKING:  # what a request holds of the cache, `radixserve.engine.kv_cache_manager`'s
    from radixserve.cache.radix_cache import MatchResult
    from radixserve.cache.radix_tree import RadixNode


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
    group_id: str = ""  # the request id clients know; "" = request_id
    cache_scope: str = ""  # whose KV it may share (`cache_scope`); "" = the default scope
    namespace: bytes | None = None  # its pages' hash namespace; None = the engine's own
    adapter: str = ""  # the LoRA adapter it runs with, by name; "" = the base model
    tenant: str = ""  # whose it is, for the fair share (an opaque id); "" = the default tenant
    priority: int = 0  # lower = sooner (every waiting request of a lower value goes first)
    weight: float = 1.0  # its tenant's weight: its share of slots and prefill tokens
    index: int = 0  # the choice within its group
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in page_ids
    # its prompt's cache hits: a host read's, then the device's at first admission
    cached: CachedTokens = field(default_factory=CachedTokens)
    num_computed_prompt_tokens: int = 0  # prompt tokens this request actually ran through the model
    locked_node: RadixNode | None = None
    # the radix match taken at admission: (cache version, tokens matched over, result)
    match: tuple[int, int, MatchResult] | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    admitted_once: bool = False
    lease_s: float | None = None  # prefill-only: hold the prompt's pages this long when done
    guide: Any = None  # structured output: the llguidance matcher, advanced per token
    forked: bool = False  # choices 1..n-1 exist (or n == 1)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # scored so far
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    group: list[Request] = field(default_factory=list)  # every member, this one included
    thinking: ThinkingBudget | None = None  # its thinking-token budget, fed every token
    draft: list[int] = field(default_factory=list)  # this step's draft tokens (`speculation`)
    draft_method: str = ""  # where they came from: "prompt" or "radix"

    def __post_init__(self) -> None:
        if self.thinking is None:
            self.thinking = ThinkingBudget.of(self.params)
        if not self.group_id:
            self.group_id = self.request_id
        if not self.group:
            self.group.append(self)

    def fork_child(self, index: int, detokenizer: IncrementalDetokenizer) -> Request:
        """Choice ``index`` of this request's group (it joins the group; it holds no pages
        yet: `Scheduler.fork` shares this request's)."""
        child = Request(
            request_id=f"{self.request_id}#{index}",
            prompt_ids=self.prompt_ids,
            params=self.params,
            detokenizer=detokenizer,
            group_id=self.group_id,
            cache_scope=self.cache_scope,
            namespace=self.namespace,
            adapter=self.adapter,
            tenant=self.tenant,
            priority=self.priority,
            weight=self.weight,
            index=index,
            arrival_time=self.arrival_time,
            group=self.group,
        )
        child.forked = child.prompt_logprobs_sent = True
        child.cached = self.cached
        child.guide = self.guide.deep_copy() if self.guide is not None else None
        self.group.append(child)
        return child

    @property
    def scores_prompt(self) -> bool:
        """True while prompt log-probabilities are wanted and not all computed: the
        request then computes its prompt without the cache."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_ids) - 1
        )

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
