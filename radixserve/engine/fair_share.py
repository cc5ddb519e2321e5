"""Fair share between tenants: whose waiting request and prefill tokens come next.

A request carries its `TenantShare`: its tenant (an opaque id the gateway derives from
the caller's tenant; "" for every request when the gateway has no keys), its priority
(vLLM's: an int, default 0, a lower value is served sooner) and its tenant's weight
(default 1). The scheduler (`radixserve.engine.scheduler`) uses the two parts below:

* `FairQueue` holds the waiting requests, one FIFO per (priority, tenant), and lists
  them in the order they are admitted: all of a lower priority value first; within a
  priority a weighted round robin over tenants (the k-th waiting request of a tenant of
  weight w comes at k / w, ties by arrival); within a tenant first in, first out (a
  preempted request re-queues at the head of its tenant's FIFO). With one tenant and
  one priority this is the plain FIFO the scheduler always had.
* `DeficitRoundRobin` splits a step's prefill tokens between the tenants that have
  prefill work (deficit round robin: each turn a tenant gets its quantum, weight x
  ``quantum_tokens``, scaled so the heaviest tenant's is ``quantum_tokens``, and spends
  it; a tenant that asks for no more loses its credit; the tenant whose turn the step's
  budget ended in resumes it first in the next step). Chunks are cut to the grant, so
  the split is exact to the token.
* `share_rows` picks a step's decode rows when they outnumber ``fair_step_rows`` and
  several tenants decode: on a CPU a decode step's cost grows with its rows, so one
  tenant's many streams would stretch every other tenant's inter-token time. Where a
  tenant asks at most its share (``fair_step_rows`` x its weight / the weights), each
  tenant gets a max-min fair share of the rows by weight (at least one each: the step
  takes max(``fair_step_rows``, tenants) rows; a tenant asking less than its share
  leaves the rest to the others); within a tenant the rows that waited longest go first,
  so every stream advances. With one tenant, or every tenant asking past its share (a
  cut would then only slow everyone), every decode runs in every step.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.engine.request import Request


@dataclass(frozen=True, slots=True)
class TenantShare:
    """Whose a request is, for the scheduler's fair share (module notes)."""

    tenant: str = ""  # an opaque id; "" = the one tenant of a gateway without keys
    priority: int = 0  # lower = sooner; every waiting request of a lower value goes first
    weight: float = 1.0  # the tenant's share of slots and prefill tokens, relative to others'


DEFAULT_SHARE = TenantShare()


class FairQueue:
    """The waiting requests, listed in admission order (module notes)."""

    def __init__(self) -> None:
        self._fifos: dict[tuple[int, str], deque[Request]] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._fifos.values())

    def __bool__(self) -> bool:
        return bool(self._fifos)

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(self._fifos.values())

    def append(self, req: Request) -> None:
        self._fifos.setdefault((req.priority, req.tenant), deque()).append(req)

    def appendleft(self, req: Request) -> None:
        """Queue ``req`` first among its tenant's requests of its priority."""
        self._fifos.setdefault((req.priority, req.tenant), deque()).appendleft(req)

    def remove(self, req: Request) -> None:
        key = (req.priority, req.tenant)
        fifo = self._fifos[key]
        fifo.remove(req)
        if not fifo:
            del self._fifos[key]

    def priorities(self) -> set[int]:
        return {priority for priority, _ in self._fifos}

    def tenants(self) -> dict[str, float]:
        """The tenants with a waiting request, each with its weight (its oldest's)."""
        return {tenant: fifo[0].weight for (_, tenant), fifo in self._fifos.items()}

    def heads(self, per_fifo: int) -> Iterator[Request]:
        """The first ``per_fifo`` requests of each (priority, tenant) FIFO."""
        for fifo in self._fifos.values():
            yield from itertools.islice(fifo, per_fifo)

    def ordered(self, priority: int, limit: int | None = None) -> list[Request]:
        """The waiting requests of ``priority`` in admission order (the first ``limit``)."""
        fifos = [(t, q) for (p, t), q in self._fifos.items() if p == priority]
        if len(fifos) == 1:  # one tenant: its FIFO as it stands
            return list(itertools.islice(fifos[0][1], limit))
        merged = heapq.merge(*(_keyed(tenant, fifo) for tenant, fifo in fifos))
        return [req for *_, req in itertools.islice(merged, limit)]


def _keyed(
    tenant: str, fifo: Iterable[Request]
) -> Iterator[tuple[float, float, str, int, Request]]:
    """``fifo``'s requests keyed for the weighted round robin: (k / weight, arrival,
    tenant, k) — never a tie that compares two requests."""
    for k, req in enumerate(fifo):
        yield k / req.weight, req.arrival_time, tenant, k, req


class DeficitRoundRobin:
    """Splits prefill tokens between tenants by deficit round robin (module notes); one
    per priority, its credit and turn order kept from step to step."""

    def __init__(self, quantum_tokens: int) -> None:
        self.quantum_tokens = quantum_tokens
        self._credit: dict[str, float] = {}
        self._order: deque[str] = deque()  # the turn order; the first goes first
        self._resume: str | None = None  # the tenant whose turn the last budget ended in

    def split(
        self, demand: dict[str, int], weights: dict[str, float], budget: int
    ) -> dict[str, int]:
        """Each tenant's tokens of ``budget``, at most its ``demand``; all of the
        budget is given while any demand is left (work-conserving)."""
        grant = dict.fromkeys(demand, 0)
        asking = {t for t, n in demand.items() if n > 0}
        self._order = deque([t for t in self._order if t in asking] +
                            sorted(asking.difference(self._order)))  # fmt: skip
        self._credit = {t: c for t, c in self._credit.items() if t in asking}
        top = max((weights.get(t, 1.0) for t in asking), default=1.0)
        while budget > 0 and self._order:
            tenant = self._order[0]
            credit = self._credit.get(tenant, 0.0)
            if tenant != self._resume:  # a new turn: its quantum
                credit += self.quantum_tokens * weights.get(tenant, 1.0) / top
            self._resume = None
            give = min(int(credit), demand[tenant] - grant[tenant], budget)
            grant[tenant] += give
            budget -= give
            credit -= give
            if grant[tenant] == demand[tenant]:  # asks for no more: no credit kept
                self._order.popleft()
                self._credit.pop(tenant, None)
                continue
            self._credit[tenant] = credit
            if budget == 0 and credit >= 1:
                self._resume = tenant  # its turn goes on in the next step
            else:
                self._order.rotate(-1)
        return grant


#: a CPU step's decode rows when several tenants decode (`fair_step_rows`): here a row
#: past the first adds ~2.2 ms to a ~8 ms step of the default model (bench/decode_ab.py),
#: so 4 rows keep a light tenant's tokens within ~2x of its pace alone (--scenario abuse)
CPU_FAIR_STEP_ROWS = 4


def fair_step_rows(setting: int | None, device_type: str) -> int:
    """The setting, or where unset 4 rows on a CPU and no bound (0) on a GPU (the
    gateway imports this module: no torch here)."""
    if setting is not None:
        return setting
    return CPU_FAIR_STEP_ROWS if device_type == "cpu" else 0


def share_rows(decodes: list[Request], rows: int, waited: dict[str, int]) -> list[Request]:
    """The decodes a step takes (module notes): all of them where they are at most
    ``rows`` or of one tenant; else each tenant's max-min fair share by weight, its
    longest-waiting first (``waited``: request id → the step it last decoded in)."""
    by_tenant: dict[str, list[Request]] = {}
    for req in decodes:
        by_tenant.setdefault(req.tenant, []).append(req)
    if rows <= 0 or len(decodes) <= rows or len(by_tenant) < 2:
        return decodes
    weight = {t: reqs[0].weight for t, reqs in by_tenant.items()}
    total_weight = sum(weight.values())
    if all(len(reqs) > rows * weight[t] / total_weight for t, reqs in by_tenant.items()):
        return decodes  # every tenant asks past its share: a cut would shield nobody
    # the least demanding (per weight) first: what they leave goes to those after them
    order = sorted(by_tenant, key=lambda t: (len(by_tenant[t]) / weight[t], t))
    left, weights_left = max(rows, len(by_tenant)), total_weight
    give: dict[str, int] = {}
    for tenant in order:
        share = max(1, int(left * weight[tenant] / weights_left))
        give[tenant] = min(len(by_tenant[tenant]), share, left)
        left -= give[tenant]
        weights_left -= weight[tenant]
    for tenant in order:  # rows the rounding down left: to whoever asks for more
        more = min(left, len(by_tenant[tenant]) - give[tenant])
        give[tenant] += more
        left -= more
    taken: list[Request] = []
    for tenant, reqs in by_tenant.items():
        longest = sorted(reqs, key=lambda r: waited.get(r.request_id, -1))  # stable
        taken.extend(longest[: give[tenant]])
    return taken
