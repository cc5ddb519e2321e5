"""The gateway's ring of recent requests, for the explorer (GET /debug/explorer/requests).

One `RequestRecord` per generation (an HTTP request that runs prompts), kept from its
admission until ``size`` newer ones have pushed it out: its token counts (the cached
tokens by tier as the API's usage reports them), the route its prompt took (computed on
the decode worker, loaded from the host tier, or computed on which prefill worker, from
the decode worker's last chunk), the time to its first token and between tokens as this
gateway saw them, and its trace id. It holds no prompt or output text. The ring is the
only owner of these records; the request lifecycle (`Gateway.start`) feeds it with
one call at each step: `begin`, `first_token`, `finish`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import Request

from radixserve.engine.outputs import RequestOutput
from radixserve.protocol.cached_tokens import CachedTokens
from radixserve.services.gateway.tenancy.tenants import Principal

HIT_RATE_WINDOW_S = 300.0  # the explorer's hit rates: requests finished this recently


def trace_id_of(request: Request) -> str | None:
    """The trace id the gateway's tracing gave ``request`` (``request.state.trace_id``);
    None where tracing has not set one."""
    trace_id = getattr(request.state, "trace_id", None)
    return str(trace_id) if trace_id else None


@dataclass
class RequestRecord:
    """One request as the explorer lists it; times in ms, ``started_s`` wall-clock."""

    request_id: str
    kind: str
    trace_id: str | None
    started_s: float
    prompts: int  # the request's prompts (jobs): one stream each
    tenant: str = ""  # whose request it is (listed to its tenant's keys and admins)
    status: str = "running"  # then "done", "failed" (an error) or "aborted" (client left)
    prompt_tokens: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)  # its prompts', by tier
    completion_tokens: int = 0
    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None
    finish_reason: str | None = None
    route: str = ""  # local | host | remote ("" in-process or not known)
    prefill_worker: str = ""
    decode_worker: str = ""
    finished_s: float | None = None
    _start: float = field(default_factory=time.perf_counter, repr=False)
    _first: float | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        fields = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        return {**fields, "cached": self.cached.as_dict()}


class RequestLog:
    """The last ``size`` requests (0: none kept), newest last."""

    def __init__(self, size: int) -> None:
        self._ring: collections.deque[RequestRecord] = collections.deque(maxlen=size)

    def begin(
        self, request_id: str, kind: str, trace_id: str | None, prompts: int, tenant: str = ""
    ) -> RequestRecord:
        """A request of ``tenant`` was admitted: its record (kept in the ring while it
        lasts there)."""
        record = RequestRecord(request_id, kind, trace_id, time.time(), prompts, tenant)
        if self._ring.maxlen:
            self._ring.append(record)
        return record

    @staticmethod
    def first_token(record: RequestRecord) -> None:
        """Every prompt of the request has its first output."""
        record._first = time.perf_counter()
        record.ttft_ms = round((record._first - record._start) * 1000.0, 3)

    @staticmethod
    def finish(
        record: RequestRecord, lasts: Sequence[RequestOutput | None], tokens: int, failed: bool
    ) -> None:
        """The request ended: ``lasts`` are its streams' latest outputs (None: none came),
        ``tokens`` the tokens generated over all of them; ``failed``: by an error."""
        now = time.perf_counter()
        record.finished_s = time.time()
        record.e2e_ms = round((now - record._start) * 1000.0, 3)
        outs = [out for out in lasts if out is not None]
        done = len(outs) == len(lasts) and all(out.finished for out in outs)
        record.status = "failed" if failed else "done" if done else "aborted"
        record.completion_tokens = tokens
        for out in outs:
            record.prompt_tokens += out.prompt_tokens
            record.cached += out.cached
            record.finish_reason = out.finish_reason or record.finish_reason
            record.route = out.route or record.route
            record.prefill_worker = out.prefill_worker or record.prefill_worker
            record.decode_worker = out.decode_worker or record.decode_worker
        later = tokens - record.prompts  # tokens after each prompt's first
        if record._first is not None and later > 0:
            record.itl_ms = round((now - record._first) * 1000.0 / later, 3)

    def recent(self, limit: int, caller: Principal) -> list[dict[str, Any]]:
        """The newest ``limit`` records ``caller`` may see (its tenant's; an admin's: all),
        newest first."""
        seen = [r for r in reversed(self._ring) if caller.owns(r.tenant)]
        return [r.as_dict() for r in seen[:limit]]

    def hit_rates(self, window_s: float = HIT_RATE_WINDOW_S) -> dict[str, dict[str, Any]]:
        """Per worker (and "" for all), over the requests finished in the last
        ``window_s`` through this gateway: prompt tokens, cached tokens (``cached``, as
        `CachedTokens.as_dict`), and the share cached."""
        since = time.time() - window_s
        sums: dict[str, tuple[int, CachedTokens]] = {}
        for r in self._ring:
            if r.finished_s is None or r.finished_s < since or r.status == "failed":
                continue
            for name in {"", r.decode_worker, r.prefill_worker}:  # "": every worker
                prompt, cached = sums.get(name, (0, CachedTokens()))
                sums[name] = (prompt + r.prompt_tokens, cached + r.cached)
        return {
            name: {"prompt_tokens": prompt, "cached": cached.as_dict(), "window_s": window_s,
                   "hit_rate": round(cached.total / prompt, 4) if prompt else None}
            for name, (prompt, cached) in sums.items()
        }  # fmt: skip
