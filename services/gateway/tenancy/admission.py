"""Admission: what a generation request costs, and whether it is let in now.

A request is charged its *work*: for each of its prompts, the prompt's tokens plus the
choices generated from it (``best_of``, else ``n``) times its ``max_tokens`` (`work_of`):
what it may make the cluster compute and hold, known before it runs. It holds that
charge, and one slot per sequence it decodes (each prompt's choices: an engine runs each
as a sequence of its own), from admission until its response ends (however it
ends: finished, failed, client gone, deadline, too slow); `Admission.release` returns it.

Bounds, checked in this order when a request arrives; nothing waits, a refused request
is answered at once:

1. never admissible (400): work over the tenant's share of ``max_queued_work_tokens`` or
   over its ``tokens_per_minute``, or more sequences than its share of
   ``max_queued_requests`` — retrying cannot help (OpenAI's clients retry a 429);
2. the tenant's rates (429, ``Retry-After`` = seconds until its bucket holds enough):
   ``requests_per_minute`` and ``tokens_per_minute``, token buckets of that size refilled
   evenly, shared by all the tenant's keys (`tenants.TenantLimits`);
3. the tenant's share (429): with two or more tenants, each may hold at most
   ``tenant_work_share`` of both cluster bounds; a single tenant (keys off) all of them;
4. the cluster (429): ``max_queued_requests`` sequences (reason ``in_flight``) and
   ``max_queued_work_tokens`` of work (reason ``capacity``).

A request refused at any step is charged nothing, its buckets included. Every refusal
carries its reason (`Refused.reason`), the label of the refusal counter.

Usage per tenant is per-tenant data: it is shown to admins (`snapshot`, in /debug/cache),
never in /metrics.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from radixserve.services.gateway.openai_api.plan import Plan
from radixserve.services.gateway.server.errors import RETRY_AFTER_S, OpenAIError
from radixserve.services.gateway.tenancy.tenants import TenantLimits


def work_of(plan: Plan) -> int:
    """The work a plan is charged: prompt tokens + choices x max_tokens, per prompt."""
    return sum(len(j.prompt_ids) + j.params.n * j.params.max_tokens for j in plan.jobs)


def sequences_of(plan: Plan) -> int:
    """The slots a plan takes: the sequences the engines decode for it (each prompt's
    choices; 8 choices of one prompt fill 8 of an engine's running slots)."""
    return sum(j.params.n for j in plan.jobs)


class Refused(OpenAIError):
    """A request not admitted: a 400 (it never could be) or a 429, with its reason."""

    def __init__(
        self, status: int, reason: str, message: str, retry_s: float = 0.0, param: str | None = None
    ) -> None:
        headers = None
        if status == 429:  # whole seconds, at least the usual 1
            seconds = math.ceil(round(retry_s, 6))  # (no 21 for 20.000000000000004)
            headers = {"Retry-After": str(max(RETRY_AFTER_S, seconds))}
        super().__init__(status, message, param, headers)
        self.reason = reason


class TokenBucket:
    """``per_minute`` tokens, refilled evenly (per_minute / 60 a second) up to per_minute;
    it starts full."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.size = per_minute
        self.level = float(per_minute)
        self.at = now

    def wait_s(self, cost: int, now: float) -> float:
        """Seconds until the bucket holds ``cost`` (0: it does now)."""
        self.level = min(float(self.size), self.level + (now - self.at) * self.size / 60)
        self.at = now
        return max(0.0, (cost - self.level) * 60 / self.size)

    def take(self, cost: int) -> None:
        self.level -= cost


@dataclass
class Ticket:
    """One admitted request's charge; `Admission.release` returns it once."""

    tenant: str
    work: int
    requests: int  # its sequences (prompts x choices): slots of max_queued_requests
    released: bool = False


@dataclass
class _Usage:
    work: int = 0
    requests: int = 0


class Admission:
    """The gateway's admission ledger: the only owner of what is in flight, per tenant."""

    def __init__(
        self,
        max_work: int,
        max_requests: int,
        share: float,
        limits: Mapping[str, TenantLimits],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_work = max_work
        self.max_requests = max_requests
        self.share = share if len(limits) > 1 else 1.0  # one tenant (or keys off): all
        self.tenant_work = max(1, int(max_work * self.share))
        self.tenant_requests = max(1, int(max_requests * self.share))
        self._limits = dict(limits)
        self._clock = clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._tenants: dict[str, _Usage] = {}  # tenants holding something
        self.work = 0
        self.requests = 0

    def admit(self, tenant: str, work: int, requests: int) -> Ticket:
        """Charge ``tenant`` a request of ``work`` and ``requests`` sequences, or raise
        `Refused` (charging nothing)."""
        self._check_size(tenant, work, requests)
        now = self._clock()
        rates = self._rates(tenant, work, now)
        self._check_share(tenant, work, requests)
        self._check_cluster(work, requests)
        for bucket, cost in rates:
            bucket.take(cost)
        used = self._tenants.setdefault(tenant, _Usage())
        used.work += work
        used.requests += requests
        self.work += work
        self.requests += requests
        return Ticket(tenant, work, requests)

    def release(self, ticket: Ticket) -> None:
        """Return a ticket's charge (a second call does nothing)."""
        if ticket.released:
            return
        ticket.released = True
        used = self._tenants[ticket.tenant]
        used.work -= ticket.work
        used.requests -= ticket.requests
        if not used.requests:
            del self._tenants[ticket.tenant]
        self.work -= ticket.work
        self.requests -= ticket.requests

    def _check_size(self, tenant: str, work: int, requests: int) -> None:
        tpm = self._limits.get(tenant, TenantLimits()).tokens_per_minute
        bounds = [(self.tenant_work, self._share_words("max_queued_work_tokens", tenant))]
        if tpm is not None:
            bounds.append((tpm, f"tenant {tenant}'s tokens_per_minute ({tpm})"))
        for bound, what in bounds:
            if work > bound:
                raise Refused(400, "too_large", f"this request is charged {work} tokens of work "
                              "(prompt tokens + choices x max_tokens), more than "
                              f"{what} admits at once: lower max_tokens, n or the number of "
                              "prompts", param="max_tokens")  # fmt: skip
        if requests > self.tenant_requests:
            what = self._share_words("max_queued_requests", tenant)
            raise Refused(400, "too_large", f"this request decodes {requests} sequences "
                          f"(prompts x n), more than {what} admits at once: send fewer "
                          "prompts or choices a request", param="prompt")  # fmt: skip

    def _share_words(self, setting: str, tenant: str) -> str:
        bound = getattr(self, "max_work" if setting.endswith("tokens") else "max_requests")
        if self.share == 1.0:
            return f"{setting} ({bound})"
        mine = self.tenant_work if setting.endswith("tokens") else self.tenant_requests
        share = f"tenant_work_share {self.share:g} of {setting} {bound}"
        return f"tenant {tenant}'s share ({mine}: {share})"

    def _rates(self, tenant: str, work: int, now: float) -> list[tuple[TokenBucket, int]]:
        """The tenant's buckets and what this request takes of each; `Refused` if one
        does not hold it yet."""
        limits = self._limits.get(tenant, TenantLimits())
        rates = []
        for name, per_minute, cost in (
            ("requests_per_minute", limits.requests_per_minute, 1),
            ("tokens_per_minute", limits.tokens_per_minute, work),
        ):
            if per_minute is None:
                continue
            bucket = self._buckets.get((tenant, name))
            if bucket is None:  # made once a tenant and limit, not on every request
                bucket = self._buckets[(tenant, name)] = TokenBucket(per_minute, now)
            wait_s = bucket.wait_s(cost, now)
            if wait_s > 0:
                raise Refused(429, name, f"tenant {tenant} is over its {name} ({per_minute}); "
                              f"this request takes {cost}, retry in {math.ceil(round(wait_s, 6))} s",
                              wait_s)  # fmt: skip
            rates.append((bucket, cost))
        return rates

    def _check_share(self, tenant: str, work: int, requests: int) -> None:
        if self.share == 1.0:
            return  # the cluster bounds are the tenant's
        used = self._tenants.get(tenant, _Usage())
        if used.work + work > self.tenant_work or used.requests + requests > self.tenant_requests:
            raise Refused(429, "tenant_share", f"tenant {tenant} is over its share of the "
                          f"gateway (tenant_work_share {self.share:g}): {used.work} tokens of "
                          f"work and {used.requests} sequences in flight, this request "
                          f"{work} and {requests}, its share {self.tenant_work} and "
                          f"{self.tenant_requests}; retry when its requests finish")  # fmt: skip

    def _check_cluster(self, work: int, requests: int) -> None:
        if self.requests + requests > self.max_requests:
            raise Refused(429, "in_flight", f"server busy: {self.requests} requests in "
                          f"flight (the bound is {self.max_requests}, "
                          "max_queued_requests); retry shortly")  # fmt: skip
        if self.work + work > self.max_work:
            raise Refused(429, "capacity", f"server busy: {self.work} tokens of work in "
                          f"flight, this request {work} (the bound is {self.max_work}, "
                          "max_queued_work_tokens); retry shortly")  # fmt: skip

    def snapshot(self) -> dict[str, object]:
        """What is admitted, in total and per tenant (admins only: it names tenants)."""
        return {
            "work_tokens": self.work,
            "requests": self.requests,
            "max_queued_work_tokens": self.max_work,
            "max_queued_requests": self.max_requests,
            "tenant_work_share": self.share,
            "tenants": {
                t: {"work_tokens": u.work, "requests": u.requests}
                for t, u in sorted(self._tenants.items())
            },  # fmt: skip
        }
