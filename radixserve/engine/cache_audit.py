"""The cache audit: are answers served from the prefix cache still right?

A page of the KV pool can go bad after it was cached — a stray write, a transfer that
landed in pages already handed back, a host-tier load of the wrong bytes — and every
later request that matches it is served wrong with no error anywhere. The audit
recomputes a sample of cache hits without the cache and compares:

    step() ── a request with cached tokens samples its first token
       │        sample(req)? (every 1/audit_sample_rate-th hit, exactly)
       │        └─ keep its logits row (host copy) + the cached pages' ids and hashes
       ▼
    pending jobs (at most MAX_PENDING; more are counted "skipped")
       │
    idle step (the scheduler has nothing runnable): ShadowPrefill computes the same
       │   prompt from token 0 into pages of its own, one prefill chunk per step (the
       │   most a real request arriving meanwhile waits, as behind any long prompt);
       │   real work takes the engine back at the next step (the shadow's pages are
       │   freed and the job starts over at the next idle moment)
       ▼
    judge: the cached row vs the shadow's row over the top `logits_k` tokens of each;
       differences within the dtype's tolerance → "match", else "mismatch" (logged with
       the request id and the pages) → with fail_closed the engine stops serving from
       its cache and drops what it can (`Engine.clear_audit` undoes it)

With ``audit_sample_rate`` 0 no `CacheAudit` exists: the engine's step tests one
attribute against None and does nothing else.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from radixserve.cache.block_hash import page_hashes
from radixserve.engine.detokenizer import IncrementalDetokenizer, TokenDecoder
from radixserve.engine.kv_cache_manager import KVCacheManager
from radixserve.engine.request import Request
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.scheduler import ScheduledBatch
from radixserve.settings import EngineSettings

logger = logging.getLogger(__name__)

#: sampled requests waiting for an idle step; a busy engine counts further ones "skipped"
MAX_PENDING = 8

#: The cached and the recomputed path run the same weights on the same tokens; they
#: differ only in how reductions are split (the prompt's chunks, the batch around it),
#: each split rounding to the compute dtype. So two clean rows differ by a few units of
#: the dtype's rounding (eps) relative to the logits' scale, while a bad page changes
#: attention itself and moves logits by whole units. Measured on the default model (30
#: layers) on CPU: bfloat16 with int4 weights, 0 (its kernels are batch invariant);
#: float32, at most 4.2 eps (5e-7 of the top logit). 16 eps leaves 4x that headroom for
#: kernels that are not invariant (the GPU's, not yet measured): 0.125 of the top logit in bfloat16,
#: 1.6e-2 in float16, 1.9e-6 in float32 (`tests/engine/test_cache_audit.py`).
TOLERANCE_EPS = 16.0


def make_audit(
    settings: EngineSettings, dtype: torch.dtype, tokenizer: TokenDecoder
) -> CacheAudit | None:
    """The audit ``settings`` ask for (None with ``audit_sample_rate`` 0)."""
    if settings.audit_sample_rate <= 0:
        return None
    tolerance = settings.audit_tolerance or audit_tolerance(dtype)
    return CacheAudit(settings.audit_sample_rate, settings.audit_fail_closed,
                      settings.audit_logits_k, tolerance, tokenizer)  # fmt: skip


def audit_tolerance(dtype: torch.dtype) -> float:
    """A logits row's tolerance relative to its scale: ``TOLERANCE_EPS`` x eps(dtype)."""
    return TOLERANCE_EPS * torch.finfo(dtype).eps


@dataclass
class AuditJob:
    """A sampled cache hit: what the cached path produced, and which pages it read."""

    request_id: str
    token_ids: list[int]  # the prompt whose last position's logits are compared
    cached_row: torch.Tensor  # (vocab,) float32, host: the cached path's logits
    page_ids: list[int]  # the cached prefix's pages, in order
    page_hashes: list[int]  # their chained hashes (what the cluster index knows them by)


class ShadowPrefill:
    """One job's prompt computed from scratch into pages of its own, a step at a time."""

    def __init__(self, job: AuditJob, tokenizer: TokenDecoder) -> None:
        self.job = job
        self.req = Request(
            request_id=f"audit:{job.request_id}",
            prompt_ids=job.token_ids,
            params=SamplingParams(max_tokens=1),
            detokenizer=IncrementalDetokenizer(tokenizer),
        )

    def pages_needed(self, page_size: int) -> int:
        return -(-len(self.job.token_ids) // page_size)

    def chunk(self, budget: int) -> ScheduledBatch:
        """The next ``budget`` tokens at most, as a one-request batch."""
        return ScheduledBatch([self.req], [min(budget, self.req.num_pending)])

    def advance(self, n: int) -> None:
        self.req.num_computed += n

    @property
    def done(self) -> bool:
        return self.req.num_pending == 0


class CacheAudit:
    """The audit's state — sampling, pending jobs, the shadow in progress, its counters —
    owned by the engine thread. Its shadow's pages, and whether the engine still serves
    from its cache after a mismatch, are the cache manager's (`KVCacheManager.distrust`)."""

    def __init__(
        self,
        sample_rate: float,
        fail_closed: bool,
        logits_k: int,
        tolerance: float,
        tokenizer: TokenDecoder,
    ) -> None:
        assert 0.0 < sample_rate <= 1.0, sample_rate
        self.sample_rate = sample_rate
        self.fail_closed = fail_closed
        self.logits_k = logits_k
        self.tolerance = tolerance
        self._tokenizer = tokenizer
        self._credit = 0.0  # sample_rate per cache hit; a hit is sampled at each whole 1
        self._pending: deque[AuditJob] = deque()
        self.shadow: ShadowPrefill | None = None
        self.num_checked = 0
        self.num_mismatches = 0
        self.num_skipped = 0
        self.seconds = 0.0  # spent in shadow steps

    @property
    def has_work(self) -> bool:
        return bool(self._pending) or self.shadow is not None

    def observe(
        self, sampling: Sequence[Request], logits: torch.Tensor, page_size: int, namespace: bytes
    ) -> None:
        """A step's rows (``logits`` (N, vocab), row i for ``sampling[i]``): keep the rows
        of sampled cache hits at their first token, with the ids and hashes of the pages
        their cached prefix read (``namespace``: the engine's, for the default scope)."""
        for i, req in enumerate(sampling):
            if req.output_ids or req.index or req.cached.total <= 0 or req.adapter:
                continue  # not a first token of a cache hit (or a fork of one; the
                # shadow recomputes with the base model, so no adapter's either)
            self._credit += self.sample_rate
            if self._credit < 1.0:
                continue
            self._credit -= 1.0
            if len(self._pending) >= MAX_PENDING:
                self.num_skipped += 1
                continue
            num_pages = req.cached.total // page_size
            tokens = req.prompt_ids[: num_pages * page_size]
            pages = req.page_ids[:num_pages]
            hashes = page_hashes(tokens, page_size, req.namespace or namespace)
            row = logits[i].detach().float().cpu()  # (vocab,)
            self._pending.append(AuditJob(req.group_id, list(req.prompt_ids), row, pages, hashes))

    def next_shadow(self) -> ShadowPrefill | None:
        """The shadow in progress, else one for the oldest pending job (None: no work)."""
        if self.shadow is None and self._pending:
            self.shadow = ShadowPrefill(self._pending.popleft(), self._tokenizer)
        return self.shadow

    def run_shadow(
        self, kv: KVCacheManager, run: Callable[[ScheduledBatch], torch.Tensor], chunk_tokens: int
    ) -> float | None:
        """The engine is idle: compute the next ``chunk_tokens`` of the shadow prefill
        (``run`` returns a batch's logits (rows, vocab); what a request arriving meanwhile
        may wait for, as behind any long prompt; its pages are free ones or evicted, never
        preempted) and judge it once computed. The seconds it took; None if skipped."""
        shadow = self.next_shadow()
        assert shadow is not None
        pages = kv.allocate(shadow.pages_needed(kv.page_size) - len(shadow.req.page_ids))
        if pages is None:
            self.skip_shadow(kv)
            return None
        shadow.req.page_ids.extend(pages)
        start = time.perf_counter()
        batch = shadow.chunk(chunk_tokens)
        logits = run(batch)
        shadow.advance(batch.num_new_tokens[0])
        if shadow.done and self.judge(logits[0], kv) and self.fail_closed:
            dropped = kv.distrust()
            logger.error("cache audit failed closed: %d cached pages dropped, the cache serves "
                         "nothing until cleared", dropped)  # fmt: skip
        spent = time.perf_counter() - start
        self.seconds += spent
        return spent

    def yield_shadow(self, kv: KVCacheManager) -> None:
        """Real work is back: free the shadow's pages; its job starts over when idle."""
        if self.shadow is None:
            return
        kv.drop(self.shadow.req.page_ids)
        self._pending.appendleft(self.shadow.job)
        self.shadow = None

    def skip_shadow(self, kv: KVCacheManager) -> None:
        """The shadow cannot run (no pages to spare): drop its job, counted "skipped"."""
        assert self.shadow is not None
        kv.drop(self.shadow.req.page_ids)
        self.shadow = None
        self.num_skipped += 1

    def judge(self, row: torch.Tensor, kv: KVCacheManager) -> bool:
        """The finished shadow's last-position logits ``row`` (vocab,) against the cached
        path's; returns True on a mismatch (counted and logged)."""
        assert self.shadow is not None
        job = self.shadow.job
        kv.drop(self.shadow.req.page_ids)
        self.shadow = None
        diff, scale = compare_rows(job.cached_row, row.detach().float().cpu(), self.logits_k)
        self.num_checked += 1
        if diff <= self.tolerance * scale:
            logger.debug("cache audit of %s: match (max |diff| %.3g)", job.request_id, diff)
            return False
        self.num_mismatches += 1
        logger.error(
            "cache audit: request %s was served from cached pages that do not reproduce "
            "its logits (max |diff| %.4g over the top %d tokens, tolerance %.4g); pages %s, "
            "page hashes %s%s",
            job.request_id, diff, self.logits_k, self.tolerance * scale, job.page_ids,
            [f"{h:016x}" for h in job.page_hashes],
            "; failing closed: the cache serves nothing until cleared" if self.fail_closed else "",
        )  # fmt: skip
        return True

    def stats(self) -> dict[str, int]:
        return {
            "audit_checked": self.num_checked,
            "audit_mismatches": self.num_mismatches,
            "audit_skipped": self.num_skipped,
            "audit_pending": len(self._pending) + (self.shadow is not None),
        }


def compare_rows(cached: torch.Tensor, shadow: torch.Tensor, k: int) -> tuple[float, float]:
    """(max |cached - shadow| over the union of both rows' top-k tokens, the larger of 1
    and the largest |logit| among them): the tokens sampling can pick, at the row's scale."""
    k = min(k, cached.numel())
    ids = torch.cat([cached.topk(k).indices, shadow.topk(k).indices]).unique()
    a, b = cached[ids], shadow[ids]  # (m,)
    diff = float((a - b).abs().max())
    scale = max(1.0, float(torch.maximum(a.abs(), b.abs()).max()))
    return diff, scale
