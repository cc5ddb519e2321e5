"""The prefill worker: compute a prompt's KV, sample its first token, lend the pages.

For each `PrefillRequest` from a decode worker:

1. the engine computes the prompt past what this worker's radix cache holds, after
   loading what the kvstore's host tier adds to it, admitted in one engine operation
   (`Worker.admit` with a lease), samples the first token (of each of the request's
   ``n`` choices) and keeps the prompt's pages under a lease of ``lease_s`` seconds;
2. the worker answers `KVReady` with the first token(s), their log-probabilities and
   the prompt's when the request asks for them, and ``src_page_ids``: its pages
   holding the prompt past the decode side's ``num_cached_tokens``, i.e. exactly the
   pages the decode worker lacks, one per ``dst_page_ids`` entry;
3. the decode worker pulls them (`KVTransferAgent.read_pages`: the agent serves it only
   those pages, granted to it by name until the lease is released or ends) and sends
   `TransferDone`, which releases the lease. A decode worker that never does (dead,
   timed out) costs the pages only until the lease expires. While pages are lent, the
   worker calls `serve_reads` every 200 µs so the reads progress on its side.

An `Abort` cancels the computation or releases the lease, whichever applies. While
draining (SIGTERM) the worker refuses new `PrefillRequest`s ("draining": the decode
worker prefills elsewhere) and leaves once the pages it lent have been read.

Per request it also records, for the autoscaler, its uncached prompt tokens and its
wait: the time from its arrival to its first token less its own compute (those tokens
at this worker's measured prefill rate) — histograms ``prefill_request_tokens`` and
``prefill_wait_seconds`` in its stats, so a long prompt's own compute is told apart
from time spent behind other prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.wire import to_entries, to_params, to_share
from radixserve.errors import UnknownAdapterError
from radixserve.metrics import PREFILL_TOKENS_BUCKETS, PREFILL_WAIT_BUCKETS, StatsHistogram
from radixserve.protocol import Abort, KVReady, PrefillRequest, TransferDone
from radixserve.protocol.stats_messages import PrefillSection, ServiceStats, fill
from radixserve.runtime.service import Handlers, Peer
from radixserve.runtime.worker import Worker, WorkerInbound
from radixserve.services.prefill.settings import PrefillSettings
from radixserve.tracing import NO_SPAN

logger = logging.getLogger(__name__)


def _first_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Each choice's output holding its first token, in choice order (a request with n
    choices samples n first tokens from the prompt's logits; the KV is shared)."""
    firsts: dict[int, RequestOutput] = {}
    for output in outputs:
        if output.new_token_ids and output.index not in firsts:
            firsts[output.index] = output
    return [firsts[i] for i in sorted(firsts)]


class AdapterMismatch(Exception):
    """The request's LoRA adapter is not served here with the decode side's content: the
    decode worker computes it itself (answered as an ``internal`` failure, which it
    recomputes, never as the request's own fault)."""


#: what the prefill worker's peers send it: decode workers' requests, an operator's queries
PrefillInbound = WorkerInbound | PrefillRequest | TransferDone | Abort


class PrefillWorker(Worker):
    role = "prefill"
    refused_while_draining = (PrefillRequest,)
    settings: PrefillSettings

    def __init__(self, settings: PrefillSettings, engine: AsyncEngine) -> None:
        super().__init__(settings, engine)
        self._queued = 0  # prompt tokens of requests without their first token yet
        self._owner: dict[str, bytes] = {}  # request id -> identity of the decode worker
        self._wait = StatsHistogram(PREFILL_WAIT_BUCKETS)
        self._request_tokens = StatsHistogram(PREFILL_TOKENS_BUCKETS)

    def handlers(self) -> Handlers:
        return {**super().handlers(), PrefillRequest: self._request, Abort: self._abort}

    def _request(self, peer: Peer, msg: PrefillRequest) -> None:
        self._owner[msg.request_id] = peer.identity
        self.spawn(msg.request_id, self._prefill(peer, msg))

    def _abort(self, _peer: Peer, msg: Abort) -> None:
        if not self.cancel(msg.request_id):
            self.release_lent(msg.request_id)

    def on_peer_lost(self, peer: Peer) -> None:
        super().on_peer_lost(peer)
        for request_id, identity in list(self._owner.items()):
            if identity == peer.identity and not self.cancel(request_id):
                self.release_lent(request_id)

    def queued_tokens(self) -> int:
        return self._queued

    def stats(self) -> ServiceStats:
        prefill = fill(PrefillSection, self.counters, prefill_wait_seconds=self._wait.stats(),
                       prefill_request_tokens=self._request_tokens.stats())  # fmt: skip
        return dataclasses.replace(super().stats(), prefill=prefill)

    def _record(self, computed: int, elapsed_s: float) -> None:
        """Split one request's time to its first token into its own compute (``computed``
        tokens at the engine's measured prefill rate) and the wait around it."""
        rate = self.engine.stats().prefill_tokens_per_s
        own = computed / rate if rate > 0 else 0.0
        self._wait.observe(max(0.0, elapsed_s - own))
        self._request_tokens.observe(computed)

    def release_lent(self, lease_id: str) -> None:
        self._owner.pop(lease_id, None)
        super().release_lent(lease_id)

    async def _prefill(self, peer: Peer, msg: PrefillRequest) -> None:
        rid, ids = msg.request_id, list(msg.token_ids)
        arrived = time.perf_counter()
        self._queued += len(ids)
        self.beat_now()  # routers see the queue change now, not a heartbeat later
        counted = True
        leased = False
        # spans under the decode worker's remote prefill, carried back on KVReady: the
        # queue (arrival to admission: a host-tier load included), then the compute
        # (admission to the first token: a wait for a batch slot included)
        request = self.tracer.join(msg.traceparent)
        queued = request.child("prefill.queue", prompt_tokens=len(ids))
        computing = NO_SPAN
        try:
            params = to_params(msg.sampling)
            fingerprint = self.loras.fingerprint(msg.adapter)
            if fingerprint != msg.adapter_fingerprint:  # not the decode side's adapter
                raise AdapterMismatch(
                    f"{self.name} serves LoRA adapter {msg.adapter!r} as "
                    f"{fingerprint or 'nothing'!r}, the request's is {msg.adapter_fingerprint!r}"
                )
            try:
                _, out = await self.admit(rid, ids, params, hashes=msg.page_hashes or None,
                                          lease_s=self.settings.lease_s,
                                          cache_scope=msg.cache_scope, share=to_share(msg),
                                          adapter=msg.adapter, under=queued)  # fmt: skip
            except UnknownAdapterError as exc:  # unloaded since the check above
                raise AdapterMismatch(f"{self.name}: {exc}") from exc
            # what it runs with, now that it holds the adapter (no unload until it ends):
            # `KVReady` says so, and the decode side reads the pages only if it is its own
            fingerprint = self.loras.fingerprint(msg.adapter)
            queued.end()
            # the engine's lease starts when the prompt is done, after this: a grant that
            # ends lease_s from now ends first
            grant_until = asyncio.get_running_loop().time() + self.settings.lease_s
            computing = request.child("prefill.compute")
            outputs = [output async for output in self.engine.outputs(rid, out)]
            last = outputs[-1]
            firsts = _first_outputs(outputs)  # one per choice, in index order
            assert last.finished and firsts
            leased = True
            self._queued -= len(ids)
            counted = False
            self.beat_now()
            leased_pages = (o.leased_page_ids for o in outputs if o.index == 0)
            pages = next((p for p in leased_pages if p is not None), None)
            if pages is None:
                raise TimeoutError(f"the lease of {rid} expired before it was handed over")
            src = pages[msg.num_cached_tokens // self.page_size :]
            if len(src) != len(msg.dst_page_ids):
                raise ValueError(
                    f"decode asked for {len(msg.dst_page_ids)} pages past token "
                    f"{msg.num_cached_tokens}; the prompt has {len(src)}"
                )
            self.lending.grant(rid, peer.name, list(src), grant_until)
            computed = last.prompt_tokens - last.cached.total
            self._record(computed, time.perf_counter() - arrived)
            tiers = {f"cached_{tier}": n for tier, n in last.cached.by_tier().items()}
            computing.end(None, computed_tokens=computed, **tiers)
            self.counters["prefill_requests_total"] += 1
            self.counters["prefill_computed_tokens_total"] += computed
            self.counters["prefill_cached_tokens_total"] += last.cached.total
            tokens = [o.new_token_ids[0] for o in firsts]
            await self.send_to(
                peer,
                KVReady(
                    request_id=rid,
                    first_token_ids=tuple(tokens),
                    src_page_ids=tuple(src),
                    cached=last.cached,
                    first_logprobs=to_entries([o.logprobs[0] for o in firsts if o.logprobs]),
                    prompt_logprobs=to_entries(firsts[0].prompt_logprobs),
                    spans=request.records(),
                    lease_ms=max(0.0, grant_until - asyncio.get_running_loop().time()) * 1000,
                    adapter_fingerprint=fingerprint,
                ),
            )
        except asyncio.CancelledError:
            # Even before `leased`: the request may have finished (and taken its lease)
            # in the step that was running when the abort came; this releases it after.
            self.release_lent(rid)
            raise
        except Exception as exc:
            if leased:
                self.release_lent(rid)
            queued.end(exc)
            computing.end(exc)
            await self.fail(peer, rid, exc)
        finally:
            queued.end("cancelled")  # no-ops for spans already ended
            computing.end("cancelled")
            if counted:
                self._queued -= len(ids)
            if not leased:
                self._owner.pop(rid, None)
