"""Picks each step's work within a token budget, first tokens first.

Every running request computes the next chunk of `token_ids[num_computed:]`; a chunk of
one token is a decode. A step takes, in this order, until ``max_num_batched_tokens``
tokens are spent:

1. every running decode, one token each — so a decode waits at most one step (of at
   most ``max_num_batched_tokens`` tokens) between two tokens (with several tenants
   decoding more rows than ``fair_step_rows``, each tenant's fair share of them:
   `fair_share.share_rows`);
2. waiting requests whose uncached delta fits in one chunk (``prefill_chunk_tokens``):
   a cached turn of a conversation; oldest first. Admitted between two steps, such a
   request computes its whole delta in the very next step: its first token comes at the
   end of it, whatever else is queued;
3. running prefills, shortest remaining first, the next chunk of each (at most
   ``prefill_chunk_tokens``): a long prompt advances a chunk per step and so never holds
   a short one back by more than that;
4. waiting requests with longer uncached prompts, oldest first, their first chunk.

With several tenants or priorities (`radixserve.engine.fair_share`), tiers 2-4 run once
per priority, the lowest value first; waiting requests are taken in the `FairQueue`'s
order (a weighted round robin over tenants); and the step's prefill tokens, what the
decodes leave, are split between the tenants with prefill work by `DeficitRoundRobin`
(each request's chunk is cut to what is left of its tenant's grant); tokens a tenant's
grant left unused go, in a second pass over the tiers, to whoever can use them. All slots
taken, a waiting request preempts a running one: the newest of a worse priority if any,
else, at its own priority, the newest of the tenant furthest over its share of slots
(``max_num_seqs`` x its weight / the weights of the tenants with requests) when its own
tenant is under its share. With one tenant and one priority none of this changes a step.

Pages come from the cache manager (`KVCacheManager.grow`: evict if short, then allocate,
in runs the CPU decode attention reads in place); when even evicting is not enough the
newest running request of the worst priority (the highest value) is preempted (its KV
goes into the cache, its pages are released, it re-queues first) and `grow` is retried.

Requests with LoRA adapters: the running set holds at most ``max_adapters`` distinct
adapters (the device's adapter slots, `radixserve.model.lora_manager`), so any step's
adapters fit in them; a waiting request of another adapter keeps its place until a
running one's adapter leaves.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.engine.fair_share import DeficitRoundRobin, FairQueue, share_rows
from radixserve.engine.kv_cache_manager import KVCacheManager
from radixserve.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


#: tokens a tenant's grant has left this step, by tenant; None: not split (one tenant)
Grants = dict[str, int] | None


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: request i computes its next `num_new_tokens[i]` tokens."""

    requests: list[Request]
    num_new_tokens: list[int]


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        prefill_chunk_tokens: int | None = None,
        fair_quantum_tokens: int = 256,
        fair_step_rows: int = 0,
        max_adapters: int = 0,
    ) -> None:
        self.kv = kv  # every page a request holds comes from it and goes back to it
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_tokens = min(
            prefill_chunk_tokens or max_num_batched_tokens, max_num_batched_tokens
        )
        self.waiting = FairQueue()
        self.fair_quantum_tokens = fair_quantum_tokens  # a weight-1 tenant's prefill turn
        self._drr: dict[int, DeficitRoundRobin] = {}  # by priority
        self.fair_step_rows = fair_step_rows  # 0: every decode in every step
        self._steps = 0  # steps scheduled
        self._decoded_at: dict[str, int] = {}  # request id → the step it last decoded in
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.awaiting_kv: dict[str, Request] = {}  # prompt pages reserved for a KV transfer
        self.max_adapters = max_adapters  # distinct LoRA adapters running at once

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def pending_prompt_tokens(self) -> int:
        """Prompt tokens of waiting and running requests not computed yet."""
        return sum(
            max(0, len(r.prompt_ids) - r.num_computed) for r in (*self.waiting, *self.running)
        )

    def schedule(self) -> ScheduledBatch | None:
        """This step's work, tier by tier (see the module notes); None if there is none."""
        chosen: dict[str, tuple[Request, int]] = {}
        budget = [self.max_num_batched_tokens]  # tokens left in this step
        decodes = [r for r in self.running if r.num_pending == 1]
        drafting = [r for r in decodes if r.draft]
        prefills = sorted(
            (r for r in self.running if r.num_pending > 1),
            key=lambda r: (r.priority, r.num_pending),
        )  # by priority, then shortest remaining first; stable: otherwise in admission order
        self._steps += 1
        if self.fair_step_rows and len(decodes) > self.fair_step_rows:
            decodes = share_rows(decodes, self.fair_step_rows, self._decoded_at)
        for req in decodes:  # with a draft (`speculation`): its tokens too, if pages
            if req.draft and not self.kv.grow(req, req.num_tokens + len(req.draft)):
                req.draft = []  # (a draft never preempts anyone)
            self._take_running(req, 1 + len(req.draft), chosen, budget)
            self._decoded_at[req.request_id] = self._steps
        grants = self._split(prefills, budget[0])
        self._take_prefills(prefills, chosen, budget, grants)
        if grants is not None and budget[0] > 0:  # what a grant left unused: anyone's
            prefills = sorted((r for r in self.running if r.num_pending > 1),
                              key=lambda r: (r.priority, r.num_pending))  # fmt: skip
            self._take_prefills(prefills, chosen, budget, None)
        for req in drafting:  # a draft cut to what the step gave (none if preempted)
            given = chosen[req.request_id][1] if req.request_id in chosen else 1
            req.draft = req.draft[: given - 1]
        if not chosen:
            return None
        items = list(chosen.values())
        return ScheduledBatch([r for r, _ in items], [n for _, n in items])

    def _take_prefills(
        self,
        prefills: list[Request],
        chosen: dict[str, tuple[Request, int]],
        budget: list[int],
        grants: Grants,
    ) -> None:
        """Tiers 2-4 (module notes), once per priority, the lowest value first."""
        chunk = self.prefill_chunk_tokens
        for priority in sorted({r.priority for r in prefills} | self.waiting.priorities()):
            self._take_waiting(chosen, budget, grants, priority, short=True)
            for req in prefills:
                if req.priority == priority:
                    self._take_running(req, min(req.num_pending, chunk), chosen, budget, grants)
            self._take_waiting(chosen, budget, grants, priority, short=False)

    def _split(self, prefills: list[Request], budget: int) -> Grants:
        """Each tenant's prefill tokens this step (`DeficitRoundRobin`, per priority, the
        lowest value first), from its running prefills' next chunks and the first chunks
        of as many of its waiting requests as there are free slots (at least one: it may
        take one by preemption); None when only one tenant has prefill work."""
        free = max(1, self.max_num_seqs - len(self.running))
        chunk = self.prefill_chunk_tokens
        demand: dict[int, Counter[str]] = {}
        weights = self.waiting.tenants()
        for req in prefills:
            demand.setdefault(req.priority, Counter())[req.tenant] += min(req.num_pending, chunk)
            weights.setdefault(req.tenant, req.weight)
        if len(weights) < 2:
            return None
        for req in self.waiting.heads(free):
            tokens = min(self.uncached_tokens(req), chunk)
            demand.setdefault(req.priority, Counter())[req.tenant] += tokens
        grants: dict[str, int] = dict.fromkeys(weights, 0)
        for priority in sorted(demand):
            drr = self._drr.setdefault(priority, DeficitRoundRobin(self.fair_quantum_tokens))
            for tenant, n in drr.split(dict(demand[priority]), weights, budget).items():
                grants[tenant] += n
                budget -= n
        return grants

    def _take_running(
        self,
        req: Request,
        n: int,
        chosen: dict[str, tuple[Request, int]],
        budget: list[int],
        grants: Grants = None,
    ) -> None:
        """Up to ``n`` tokens of a running request this step (tokens it was given
        earlier in the step count)."""
        if budget[0] == 0 or req.status is not RequestStatus.RUNNING:
            return  # the step is full, or it was preempted earlier in this step
        had = chosen[req.request_id][1] if req.request_id in chosen else 0
        n = min(n - had, budget[0], budget[0] if grants is None else grants[req.tenant])
        if n <= 0:
            return
        if self._reserve(req, req.num_computed + had + n, chosen):
            chosen[req.request_id] = (req, had + n)
            budget[0] -= n
            if grants is not None:
                grants[req.tenant] -= n

    def _take_waiting(
        self,
        chosen: dict[str, tuple[Request, int]],
        budget: list[int],
        grants: Grants,
        priority: int,
        short: bool,
    ) -> None:
        """Admit waiting requests of ``priority`` in the queue's order: with ``short``
        only those whose uncached delta fits in one chunk (the others keep their place;
        the first ``max_num_seqs`` are looked at, which bounds the cost of a long queue),
        else any. A request whose tenant's grant is spent keeps its place."""
        limit = self.max_num_seqs if short else None
        for req in self.waiting.ordered(priority, limit):
            if budget[0] == 0:
                return
            if grants is not None and grants.get(req.tenant, 0) <= 0:
                continue
            if req.adapter and not self._adapter_room(req.adapter):
                continue  # every adapter slot is another running adapter's
            victim = None
            if len(self.running) >= self.max_num_seqs:
                victim = self._slot_victim(req)
                if victim is None:
                    if grants is None:
                        return
                    continue  # another tenant's request may be owed a slot
            if short and self.uncached_tokens(req) > self.prefill_chunk_tokens:
                continue
            if victim is not None:
                logger.info("preempting %s for a slot of %s", victim.request_id, req.request_id)
                refund = self._preempt(victim, chosen)  # its tokens go back to the step
                budget[0] += refund
                if grants is not None and victim.tenant in grants:
                    grants[victim.tenant] += refund
            self.kv.admit(req)
            n = min(req.num_pending, self.prefill_chunk_tokens, budget[0])
            if grants is not None:
                n = min(n, grants[req.tenant])
            if not self._reserve(req, req.num_computed + n, None):
                self.kv.release(req, cache_kv=False)
                return  # no pages for it now: nor for those behind it
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chosen[req.request_id] = (req, n)
            budget[0] -= n
            if grants is not None:
                grants[req.tenant] -= n

    def num_waiting_for_adapter(self) -> int:
        """Waiting requests held back only by the adapter slots: each names a LoRA adapter
        that is not running while every one of the ``max_adapters`` slots is another
        running adapter's (none while a slot is free: O(1) then, else O(waiting))."""
        running = {r.adapter for r in self.running if r.adapter}
        if len(running) < self.max_adapters:
            return 0
        return sum(1 for r in self.waiting if r.adapter and r.adapter not in running)

    def _adapter_room(self, adapter: str) -> bool:
        """Whether a request of LoRA ``adapter`` may run beside the running ones."""
        running = {r.adapter for r in self.running if r.adapter}
        return adapter in running or len(running) < self.max_adapters

    def _slot_victim(self, req: Request) -> Request | None:
        """The running request ``req`` may take the slot of, all being taken (module
        notes); None if none."""
        worst = max(reversed(self.running), key=lambda r: r.priority)  # the newest of them
        if worst.priority > req.priority:
            return worst
        weights = self.waiting.tenants()
        for r in self.running:
            weights.setdefault(r.tenant, r.weight)
        total = sum(weights.values())
        held = Counter(r.tenant for r in self.running)

        def share(tenant: str) -> float:
            return self.max_num_seqs * weights[tenant] / total

        if held[req.tenant] + 1 > share(req.tenant):
            return None
        over = [t for t in held if held[t] > share(t)]
        if not over:
            return None
        tenant = max(over, key=lambda t: held[t] / weights[t])
        same = [r for r in self.running if r.tenant == tenant and r.priority == req.priority]
        return same[-1] if same else None

    def uncached_tokens(self, req: Request) -> int:
        """Tokens ``req`` would compute if admitted now (its cache hit looked up, nothing
        locked; the last token is always computed; a scored prompt skips the cache)."""
        match = self.kv.match(req)
        return req.num_tokens - (match.num_tokens if match is not None else 0)

    def after_step(self, batch: ScheduledBatch) -> None:
        """Account the computed tokens; share finished prompt chunks through the cache."""
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if req.draft:  # its pending token only: the engine counts the accepted drafts
                req.num_computed += 1
                continue
            if req.num_computed < len(req.prompt_ids):
                req.num_computed_prompt_tokens += min(n, len(req.prompt_ids) - req.num_computed)
            req.num_computed += n
            if n > 1:
                self.kv.share(req)

    def reserve_remote(self, req: Request) -> bool:
        """Lock `req`'s cached prefix and give it pages for the rest of its prompt, to be
        filled by a KV transfer. False (nothing held) if the pool cannot spare them now."""
        self.kv.admit(req)
        if not self._reserve(req, len(req.prompt_ids), None):
            self.kv.release(req, cache_kv=False)
            return False
        req.status = RequestStatus.AWAITING_KV
        self.awaiting_kv[req.request_id] = req
        return True

    def activate_remote(self, req: Request) -> None:
        """The transfer filled `req`'s pages: its whole prompt has KV; it decodes from now."""
        del self.awaiting_kv[req.request_id]
        req.num_computed = len(req.prompt_ids)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def fork(self, parent: Request, child: Request, copy_page: Callable[[int, int], None]) -> bool:
        """Start ``child`` running from ``parent``'s computed tokens (`KVCacheManager.fork`:
        shared full pages, a copied partial one). False, with nothing held, if no page
        can be found for the copy."""
        if not self.kv.fork(parent, child, copy_page):
            return False
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        return True

    def requeue(self, req: Request) -> None:
        """Queue a request that holds no pages first in line (a fork that found none)."""
        req.status = RequestStatus.WAITING
        req.admitted_once = True
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """End a request (any state): insert its KV into the cache, return every page."""
        cache_kv = reason != "abort"
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.AWAITING_KV:
            del self.awaiting_kv[req.request_id]
            cache_kv = False  # its reserved pages were never filled
        self.kv.release(req, cache_kv=cache_kv)
        self._decoded_at.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    # -- pages ------------------------------------------------------------------------

    def _reserve(
        self, req: Request, num_tokens: int, chosen: dict[str, tuple[Request, int]] | None
    ) -> bool:
        """Give `req` pages for `num_tokens` tokens, evicting and (if `chosen` is given,
        i.e. `req` is running) preempting newer requests. False if it cannot."""
        while not self.kv.grow(req, num_tokens):
            if chosen is None or not self._preempt_newest(req, chosen):
                return False
        return True

    def _preempt_newest(self, req: Request, chosen: dict[str, tuple[Request, int]]) -> bool:
        """Preempt the newest running request of the worst priority (the highest value;
        never one more urgent than `req`, which is running); False if that was `req`."""
        victim = max(reversed(self.running), key=lambda r: r.priority)
        logger.info("preempting %s to free KV pages", victim.request_id)
        self._preempt(victim, chosen)
        return victim is not req

    def _preempt(self, victim: Request, chosen: dict[str, tuple[Request, int]]) -> int:
        """Stop a running request: its KV into the cache, its pages released, queued
        first among its tenant's. Returns the tokens it had been given this step."""
        _, n = chosen.pop(victim.request_id, (victim, 0))
        self.running.remove(victim)
        self.kv.release(victim, cache_kv=True)
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        return n
