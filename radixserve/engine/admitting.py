"""An engine's ways in, mixed into `Engine`: a request queued to compute here
(`add_request`), or admitted by a worker in one operation that decides how its prompt
gets its KV (`admit`, `radixserve.engine.admission`: here, from a prefill worker, or from
the host tier or a peer, then `finish_host_admission`), and the leases of cached
prefixes another worker reads (`lend_prefix`, `release_lease`). The decode side of
disaggregation (`Engine.activate_remote`) forks and appends tokens: it stays with the
step."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixserve.engine.admission import Admission, HostPlan, choose_route
from radixserve.engine.fair_share import DEFAULT_SHARE, TenantShare
from radixserve.engine.sampling_params import SamplingParams
from radixserve.protocol.cached_tokens import CachedTokens

if TYPE_CHECKING:
    from radixserve.engine.intake import RequestIntake
    from radixserve.engine.kv_cache_manager import KVCacheManager
    from radixserve.engine.request import Request
    from radixserve.engine.scheduler import Scheduler
    from radixserve.engine.step_stats import StepStats


class Admitting:
    intake: RequestIntake
    kv: KVCacheManager
    scheduler: Scheduler
    step_stats: StepStats
    page_size: int

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_scope: str = "",
        share: TenantShare = DEFAULT_SHARE,
        adapter: str = "",
    ) -> str:
        """Queue a request; raises RequestError subclasses for input it can never serve.
        It shares cached KV only with requests of the same ``cache_scope`` and
        ``adapter`` (a loaded LoRA adapter's name, "" for the base model; an unknown one
        raises `UnknownAdapterError`); ``share``: its tenant, priority and weight
        (`radixserve.engine.fair_share`)."""
        req = self.intake.new(prompt, params, request_id, cache_scope, share, adapter)
        self._queue(req)
        return req.request_id

    def admit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        remote_over: int | None = None,
        host: HostPlan | None = None,
        lease_s: float | None = None,
        resume: Sequence[int] = (),
        cache_scope: str = "",
        share: TenantShare = DEFAULT_SHARE,
        adapter: str = "",
    ) -> Admission:
        """Take a request in and decide how its prompt gets its KV, in one operation
        (`radixserve.engine.admission`): queued to compute here (``local``), pages
        reserved for a prefill worker to fill (``remote``, when more than ``remote_over``
        tokens would be uncached), or pages allocated for the host-tier read the caller's
        ``host`` plan leased (``host``; then `finish_host_admission`). With ``lease_s``
        (a prefill worker) only the first token is sampled and the prompt's pages are
        kept for a reader under a lease, named in the last output (``leased_page_ids``).
        With ``resume`` (a stream migrated from a worker that died) the request continues
        after those already-generated tokens (`RequestIntake.resume`); it never prefills remotely.
        Its KV is shared only with requests of the same ``cache_scope``: the caller's
        ``host`` plan and a prefill worker must use the same scope. ``share``: its tenant,
        priority and weight, for the scheduler's fair share (`radixserve.engine.fair_share`);
        ``adapter``: its LoRA adapter (`add_request`)."""
        if lease_s is not None:
            params = params or SamplingParams()
            params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        req = self.intake.new(prompt, params, request_id, cache_scope, share, adapter)
        req.lease_s = lease_s
        if resume:
            self.intake.resume(req, resume)
            remote_over = None
        ids = req.token_ids  # the prompt, and a resumed request's tokens so far
        match = self.kv.match(req)  # the one walk: scheduling reuses it
        cached = match.num_tokens if match is not None else 0
        size = self.page_size
        host_pages = 0
        # a host plan holds while the device mirror is current (never when not matching)
        if host is not None and match is not None and host.device_pages * size == cached:
            room = (len(ids) - 1) // size - host.device_pages  # never the last token
            host_pages = max(0, min(host.num_pages, room))
        route = choose_route(len(ids), cached, host_pages * size, remote_over)
        if route == "remote":
            if self.scheduler.reserve_remote(req):
                pages = tuple(req.page_ids[req.num_computed // size :])
                return Admission(req.request_id, "remote", req.num_computed, pages)
            route = "host" if host_pages else "local"  # no pages to spare now: compute here
        if route == "host":
            assert match is not None
            loading = self.kv.begin_host_load(req, match, host_pages)
            if loading is not None:
                return Admission(req.request_id, "host", cached, tuple(loading))
        self._queue(req)
        return Admission(req.request_id, "local", cached)

    def _queue(self, req: Request) -> None:
        self.scheduler.add(req)
        self.step_stats.queued_prompt_tokens += len(req.prompt_ids)

    def finish_host_admission(
        self, request_id: str, ok: bool, disk_pages: int = 0, peer: bool = False
    ) -> None:
        """The host-tier read (or, with ``peer``, the read from another worker's cache) of
        an admitted request ended: if ``ok`` its pages hold the prefix (``disk_pages`` of
        them read from the kvstore's disk tier on the way), which goes into the cache;
        either way the request is queued now (it finds what was cached). Unknown ids
        (aborted meanwhile) are ignored."""
        loaded = self.kv.finish_host_load(request_id, ok)
        req = self.intake.requests.get(request_id)
        if loaded is not None and req is not None:
            tokens = loaded * self.page_size
            disk = min(disk_pages, loaded) * self.page_size
            req.cached = (CachedTokens(peer=tokens) if peer
                          else CachedTokens(host=tokens - disk, disk=disk))  # fmt: skip
            self._queue(req)

    def lend_prefix(
        self, lease_id: str, token_ids: Sequence[int], first_page: int, num_pages: int,
        lease_s: float, cache_scope: str = "", adapter: str = "",
    ) -> list[int]:  # fmt: skip
        """Lease (`release_lease`, or ``lease_s`` from now) the pages ``first_page`` ..
        ``first_page + num_pages`` of the cached prefix of ``token_ids`` in the namespace
        of ``cache_scope`` and ``adapter``, for another worker to read: their page ids,
        only the leading ones cached (none without a cache, or while it serves nothing)."""
        cache = self.kv.cache
        if cache is None or not self.kv.serve_from_cache or num_pages <= 0:
            return []
        namespace = self.intake.namespace(cache_scope, adapter)
        match = cache.match_prefix(token_ids, namespace)
        pages = list(match.page_ids[first_page : first_page + num_pages])
        if pages:
            self.kv.lease(lease_id, pages, time.perf_counter() + lease_s)
        return pages

    def release_lease(self, request_id: str) -> bool:
        return self.kv.release_lease(request_id)
