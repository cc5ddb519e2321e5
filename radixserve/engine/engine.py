"""The engine: model + KV pool + radix cache + scheduler, stepped by its caller.

step():  batch = scheduler.schedule()          # decodes, then prefill chunks
         masks = choices.start_masks(batch)    # structured output, beside the model
         logits = runner.run(batch)            # one forward over every token
         tokens = choices.sample(logits)       # for requests at their newest token
         postprocess(tokens)                   # detokenise, stop, finish, cache

With the cache audit on (`radixserve.engine.cache_audit`), a step with nothing to
schedule runs a chunk of a shadow prefill instead, and the logits of sampled cache hits
are kept for it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TypeVar

import torch

from radixserve.cache.block_hash import hash_namespace, page_hashes, scoped_namespace
from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import MatchResult, RadixCache
from radixserve.engine.admission import Admission, HostLoad, HostPlan, choose_route
from radixserve.engine.cache_audit import CacheAudit, audit_tolerance
from radixserve.engine.cache_view import describe
from radixserve.engine.choice_sampler import ChoiceSampler
from radixserve.engine.cores import CoreBoard
from radixserve.engine.cuda_graph import make_decode_graphs
from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.device import resolve_device, resolve_dtype
from radixserve.engine.fair_share import DEFAULT_SHARE, TenantShare, fair_step_rows
from radixserve.engine.lease import LeaseTable
from radixserve.engine.model_runner import ModelRunner
from radixserve.engine.model_shard import ModelShard, copy_out, copy_page
from radixserve.engine.outputs import GenerationResult, RequestOutput, TokenLogprob
from radixserve.engine.request import Request, RequestStatus
from radixserve.engine.sampler import Sampler
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.step_stats import StepStats
from radixserve.engine.structured import GuideCompiler, advance
from radixserve.engine.tp_group import TPGroup, threads_per_rank
from radixserve.errors import CapacityError, InvalidRequestError
from radixserve.model.checkpoint import Checkpoint, load_checkpoint
from radixserve.model.fused_decode import FUSED_MAX_BATCH, FUSED_THREADS, fused_decode_for
from radixserve.model.identity import checkpoint_identity
from radixserve.model.tp import TPShard
from radixserve.protocol.messages import CacheTreeReply
from radixserve.settings import EngineSettings
from radixserve.transfer.compat import dtype_name

T = TypeVar("T")
logger = logging.getLogger(__name__)


def _describe(plan: Mapping[str, str]) -> str:
    """ "int4" when every matrix is int4, else e.g. "int4 (embed int8)"."""
    counts = collections.Counter(plan.values())
    if not counts:
        return "none"
    main = max(counts, key=lambda s: counts[s])
    others = sorted(f"{key} {s}" for key, s in plan.items() if s != main)
    if len(others) > 3:
        others = [f"{n} {s}" for s, n in counts.items() if s != main]
    return main + (f" ({', '.join(others)})" if others else "")


class Engine:
    """Synchronous engine. Not thread-safe: one thread calls add_request/step/abort."""

    def __init__(self, settings: EngineSettings, checkpoint: Checkpoint | None = None) -> None:
        """``checkpoint``: an opened checkpoint to serve instead of ``settings.model`` (for
        instance random weights of a given shape, `radixserve.bench.random_checkpoint`)."""
        self.settings = settings
        tp = TPShard(0, settings.tp)
        self.device = resolve_device(settings.device)
        if settings.num_threads or (tp.size > 1 and self.device.type == "cpu"):
            torch.set_num_threads(threads_per_rank(settings))
        self.cores: CoreBoard | None = None  # the host's cores, shared with other workers
        if settings.core_board and self.device.type == "cpu" and tp.size == 1:
            self.cores = CoreBoard(settings.core_board, settings.num_threads or os.cpu_count() or 1)
        self._last_step_s = 0.0
        self.step_stats = StepStats()
        self.dtype = resolve_dtype(settings.dtype, self.device)
        if checkpoint is not None and tp.size > 1:
            raise ValueError("a tensor-parallel engine's ranks load settings.model themselves: "
                             "it cannot serve a checkpoint object")  # fmt: skip
        if checkpoint is None:
            checkpoint = load_checkpoint(settings.model, progress=settings.load_progress)
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.max_model_len = self.config.max_model_len(settings.max_model_len)
        tp.check(self.config)  # before any rank starts: a split that cannot be is refused
        # ranks 1..tp-1 (processes) load their shards while this one loads its own
        self.tp_group = TPGroup(settings, self.device) if tp.size > 1 else None
        try:
            shard = ModelShard.build(
                settings, checkpoint, self.device, self.dtype, self.max_model_len, tp,
                self.tp_group.comm if self.tp_group else None, pace=self._sharing_cores,
            )  # fmt: skip
        except BaseException:
            if self.tp_group is not None:
                self.tp_group.ready(False, 0)  # raises, having stopped the ranks
            raise
        if self.tp_group is not None:
            self.tp_group.ready(True, shard.kv_pool.num_pages)
        self.idle()
        self.model, attention, self.kv_pool = shard.model, shard.attention, shard.kv_pool
        self.kv_shard = shard.kv_shard
        self._spill_buffer: torch.Tensor | None = None
        self.quantization = _describe(shard.plan)
        self.page_size = settings.page_size
        num_pages = self.kv_pool.num_pages
        self.allocator = PageAllocator(num_pages)
        self.identity = checkpoint_identity(checkpoint, shard.plan, dtype_name(self.dtype))
        self.namespace = hash_namespace(self.identity.key, settings.cache_salt)
        self.cache = (
            RadixCache(self.allocator, self.page_size, self.namespace)
            if settings.prefix_cache
            else None
        )
        self.scheduler = Scheduler(
            self.allocator,
            self.cache,
            self.page_size,
            settings.max_num_batched_tokens,
            settings.max_num_seqs,
            settings.prefill_chunk_tokens,
            settings.fair_quantum_tokens,
            fair_step_rows(settings.fair_step_rows, self.device.type),
        )
        graphs = None
        if self.tp_group is None:  # a captured graph would replay without the ranks
            graphs = make_decode_graphs(
                self.model, self.kv_pool, attention.name, self.max_model_len,
                settings.cuda_graph_max_batch_size, self.device,
            )  # fmt: skip
        fused = None
        if settings.fused_decode and self.tp_group is None and self.device.type == "cpu":
            fused = fused_decode_for(
                self.model, self.kv_pool.layers, min(settings.max_num_seqs, FUSED_MAX_BATCH),
                FUSED_THREADS,
            )  # fmt: skip
        self.runner = ModelRunner(
            self.model, self.kv_pool, self.device, graphs, self.tp_group, fused
        )
        self.sampler = Sampler()
        eos = self.config.eos_token_ids
        self.guides = GuideCompiler(
            self.tokenizer.to_json(), self.config.vocab_size, eos[0] if eos else None
        )
        self.choices = ChoiceSampler(self.sampler, self.guides, eos, self.device)
        self.audit = self._make_audit(settings)  # None when off: the step pays nothing
        self._requests: dict[str, Request] = {}  # by internal id (choice i > 0: "<id>#i")
        self._groups: dict[str, list[Request]] = {}  # by request id: every choice
        self._ids = itertools.count()
        self.leases = LeaseTable(self.allocator)
        self._host_loads: dict[str, HostLoad] = {}
        logger.info(
            "engine ready: %s on %s/%s%s, weights %s (%.1f MiB%s), %s kernels, %d KV pages of "
            "%d tokens (%.2f GiB%s), prefix cache %s",
            self.config.name, self.device, self.dtype,
            f" x {tp.size} ranks (tensor parallel)" if tp.size > 1 else "", self.quantization,
            self.model.weight_bytes / (1 << 20), " per rank" if tp.size > 1 else "",
            attention.name, num_pages, self.page_size, self.kv_pool.size_bytes / (1 << 30),
            " per rank" if tp.size > 1 else "", "on" if self.cache else "off",
        )  # fmt: skip

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if len(prompt) == 0:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})"
            )
        return ids

    def _new_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        cache_scope: str = "",
        share: TenantShare = DEFAULT_SHARE,
    ) -> Request:
        """Validate and register a request (not yet scheduled); its KV is shared only
        with requests of the same ``cache_scope`` (`radixserve.cache.block_hash.cache_scope`);
        ``share`` places it among other tenants' (`radixserve.engine.fair_share`)."""
        params = params or SamplingParams()
        if not (share.weight > 0 and math.isfinite(share.weight)):
            raise InvalidRequestError(f"tenant weight {share.weight} must be a positive number")
        prompt_ids = self.tokenize(prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_model_len} "
                "tokens and at least one must be left to generate"
            )
        one = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        need = one + (params.n - 1) * (one - len(prompt_ids))  # choices share the prompt
        capacity = self.allocator.num_pages * self.page_size
        if need > capacity:
            raise CapacityError(
                f"request needs up to {need} tokens of KV (prompt {len(prompt_ids)} + "
                f"{params.n} x max_tokens {params.max_tokens}) but the KV pool holds "
                f"{capacity} tokens; lower max_tokens or raise kv_cache_memory_gib"
            )
        vocab = self.config.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("thinking_start_ids", params.thinking_start_ids),
                          ("thinking_end_ids", params.thinking_end_ids)):  # fmt: skip
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequestError(
                    f"{name} token id {bad[0]} is outside the vocabulary [0, {vocab})",
                    param=name,
                )
        guide = self.guides.matcher(params.guide_kind, params.guide) if params.guide_kind else None
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._groups or request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = Request(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, params.stop, params.kept_special_ids
            ),
            cache_scope=cache_scope,
            namespace=scoped_namespace(self.namespace, cache_scope) if cache_scope else None,
            tenant=share.tenant,
            priority=share.priority,
            weight=share.weight,
        )
        req.guide = guide
        req.forked = params.n == 1
        self._requests[request_id] = req
        self._groups[request_id] = req.group
        return req

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_scope: str = "",
        share: TenantShare = DEFAULT_SHARE,
    ) -> str:
        """Queue a request; raises RequestError subclasses for input it can never serve.
        It shares cached KV only with requests of the same ``cache_scope``; ``share``:
        its tenant, priority and weight (`radixserve.engine.fair_share`)."""
        req = self._new_request(prompt, params, request_id, cache_scope, share)
        self._queue(req)
        return req.request_id

    # -- admission: local, remote (decode side of disaggregation), host tier ----------

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
    ) -> Admission:
        """Take a request in and decide how its prompt gets its KV, in one operation
        (`radixserve.engine.admission`): queued to compute here (``local``), pages
        reserved for a prefill worker to fill (``remote``, when more than ``remote_over``
        tokens would be uncached), or pages allocated for the host-tier read the caller's
        ``host`` plan leased (``host``; then `finish_host_admission`). With ``lease_s``
        (a prefill worker) only the first token is sampled and the prompt's pages are
        kept for a reader under a lease, named in the last output (``leased_page_ids``).
        With ``resume`` (a stream migrated from a worker that died) the request continues
        after those already-generated tokens (`_resume`); it never prefills remotely.
        Its KV is shared only with requests of the same ``cache_scope``: the caller's
        ``host`` plan and a prefill worker must use the same scope. ``share``: its tenant,
        priority and weight, for the scheduler's fair share (`radixserve.engine.fair_share`)."""
        if lease_s is not None:
            params = params or SamplingParams()
            params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        req = self._new_request(prompt, params, request_id, cache_scope, share)
        req.lease_s = lease_s
        if resume:
            self._resume(req, resume)
            remote_over = None
        ids = req.token_ids  # the prompt, and a resumed request's tokens so far
        match = self.scheduler.match(req)  # the one walk: scheduling reuses it
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
            loading = self._begin_host_load(req, match, host_pages)
            if loading is not None:
                return Admission(req.request_id, "host", cached, tuple(loading))
        self._queue(req)
        return Admission(req.request_id, "local", cached)

    def _resume(self, req: Request, tokens: Sequence[int]) -> None:
        """Continue ``req`` after ``tokens`` it already generated elsewhere: they become
        its output so far, fed through its detokeniser (text already sent, discarded
        here) and grammar as if sampled here. Penalties count them and seeded draws
        depend on (seed, choice, tokens so far), so the continuation is the one the
        first worker would have produced."""
        p = req.params
        if p.n != 1:
            self._forget(req)
            raise InvalidRequestError("only single-choice requests can resume (n = 1)")
        vocab = self.config.vocab_size
        if (
            len(tokens) >= p.max_tokens
            or any(not 0 <= t < vocab for t in tokens)
            or (len(req.prompt_ids) + len(tokens) >= self.max_model_len)
        ):
            self._forget(req)
            raise InvalidRequestError(
                f"cannot resume after {len(tokens)} tokens (max_tokens {p.max_tokens}, "
                f"context {self.max_model_len}, vocabulary {vocab})"
            )
        for token in tokens:
            req.output_ids.append(token)
            if req.guide is not None:
                advance(req.guide, token)
            if req.thinking is not None:
                req.thinking.add(token)
            req.detokenizer.add(token)

    def _forget(self, req: Request) -> None:
        """Unregister a request that was never queued."""
        self._requests.pop(req.request_id, None)
        self._groups.pop(req.group_id, None)

    def _queue(self, req: Request) -> None:
        self.scheduler.add(req)
        self.step_stats.queued_prompt_tokens += len(req.prompt_ids)

    def _begin_host_load(
        self, req: Request, match: MatchResult, num_pages: int
    ) -> list[int] | None:
        """Lock ``req``'s device-cached head (``match``) and allocate ``num_pages`` pages
        (evicting if needed) for the host-tier read; None if the pool cannot spare them."""
        assert self.cache is not None
        size, cached = self.page_size, match.num_tokens
        self.cache.lock(match.node)
        short = num_pages - self.allocator.num_free
        if short > 0 and self.cache.evict(short) < short:
            self.cache.unlock(match.node)
            return None
        pages = self.allocator.alloc(num_pages)
        tokens = req.token_ids[: cached + num_pages * size]
        self._host_loads[req.request_id] = HostLoad(
            tokens, list(match.page_ids), pages, match.node, req.namespace
        )
        return list(pages)

    def finish_host_admission(self, request_id: str, ok: bool, disk_pages: int = 0) -> None:
        """The host-tier read of an admitted request ended: if ``ok`` its pages hold the
        prefix (``disk_pages`` of them read from the kvstore's disk tier on the way),
        which goes into the cache; either way the request is queued now (it finds what
        was cached). Unknown ids (aborted meanwhile) are ignored."""
        load = self._host_loads.pop(request_id, None)
        if load is None:
            return
        assert self.cache is not None
        if ok:
            self.cache.insert(load.tokens, load.head_pages + load.page_ids, load.namespace)
        self.allocator.decref(load.page_ids)
        self.cache.unlock(load.node)
        req = self._requests.get(request_id)
        if req is not None:
            loaded = len(load.page_ids) if ok else 0
            req.num_host_cached_tokens = loaded * self.page_size
            req.num_disk_cached_tokens = min(disk_pages, loaded) * self.page_size
            self._queue(req)

    def release_lease(self, request_id: str) -> bool:
        return self.leases.release(request_id)

    # -- disaggregation: the decode side -----------------------------------------------

    def activate_remote(
        self,
        request_id: str,
        first_tokens: int | Sequence[int],
        cached_tokens: int | None = None,
        host_cached_tokens: int = 0,
        first_logprobs: Sequence[TokenLogprob] = (),
        prompt_logprobs: Sequence[TokenLogprob] | None = None,
        disk_cached_tokens: int = 0,
    ) -> list[RequestOutput]:
        """The reserved pages now hold the prompt's KV; continue with each choice's first
        token (one id, or n in choice order; the choices fork here) and return each
        choice's first output. ``cached_tokens`` (the prefill worker's cache hit, of
        which ``host_cached_tokens`` came from the kvstore and ``disk_cached_tokens`` of
        those from its disk tier) replaces this engine's own count; ``first_logprobs``
        (one per choice) and ``prompt_logprobs`` are the prefill side's, when the
        request asks for them."""
        req = self._requests.get(request_id)
        if req is None or req.status is not RequestStatus.AWAITING_KV:
            raise InvalidRequestError(f"request {request_id!r} is not awaiting KV")
        tokens = [first_tokens] if isinstance(first_tokens, int) else list(first_tokens)
        if len(tokens) != req.params.n or len(first_logprobs) not in (0, len(tokens)):
            raise InvalidRequestError(
                f"request {request_id!r} has {req.params.n} choices; got {len(tokens)} first "
                f"tokens and {len(first_logprobs)} log-probabilities"
            )
        self.scheduler.activate_remote(req)
        if cached_tokens is not None:
            req.num_cached_tokens = cached_tokens
            req.num_computed_prompt_tokens = len(req.prompt_ids) - cached_tokens
        req.num_host_cached_tokens = host_cached_tokens
        req.num_disk_cached_tokens = disk_cached_tokens
        if prompt_logprobs is not None:
            req.prompt_logprobs = list(prompt_logprobs)
        members = [req] if req.forked else [req, *self._fork(req)]
        now = time.perf_counter()
        lps: list[TokenLogprob | None] = [*first_logprobs] or [None] * len(members)
        return [self._append(m, t, now, lp) for m, t, lp in zip(members, tokens, lps)]

    def _take_cores(self) -> None:
        """Mark this worker busy on the core board and compute on its share of them."""
        if self.cores is not None:
            share = self.cores.acquire(self._last_step_s)
            if share != self.step_stats.cpu_threads:
                torch.set_num_threads(share)
                self.step_stats.cpu_threads = share

    def _sharing_cores(self, items: Iterator[T]) -> Iterator[T]:
        """``items``, taking this worker's share of the cores before each: workers loading
        together (``radixserve up`` starts two) split the cores instead of oversubscribing
        them, which with OpenMP's spinning threads made each load several times slower."""
        for item in items:
            self._take_cores()
            yield item

    def idle(self) -> None:
        """Nothing left to compute: other workers on the core board may take its cores."""
        if self.cores is not None:
            self.cores.release()

    def has_unfinished(self) -> bool:
        """Requests to compute, or (idle) a cache audit's shadow prefill to run."""
        return self.scheduler.has_work or (self.audit is not None and self.audit.has_work)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop every choice of a request and return its pages; None if unknown/finished."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        live = [m for m in group if m.status is not RequestStatus.FINISHED]
        for member in live:
            self._requests.pop(member.request_id, None)
            if member.request_id in self._host_loads:  # waiting for its host read: not queued
                self.finish_host_admission(member.request_id, ok=False)
                member.status, member.finish_reason = RequestStatus.FINISHED, "abort"
                continue
            self.scheduler.finish(member, "abort")
        return self._output(live[0] if live else group[0], [], "")

    def step(self) -> list[RequestOutput]:
        self.leases.expire(time.perf_counter())
        if self.audit is not None:
            if self.scheduler.has_work:  # real work first: the shadow gives its pages back
                self.audit.yield_shadow(self.allocator)
            elif self.audit.has_work:
                self._audit_step()
                return []
        batch = self.scheduler.schedule()
        if batch is None:
            self.idle()
            return []
        self._take_cores()
        start = time.perf_counter()
        masks = self.choices.start_masks(batch)  # computed while the model runs
        logits, sampling, prompt_logits = self.runner.run(batch)
        if self.audit is not None:
            self.audit.observe(sampling, logits, self._cached_pages)
        self.scheduler.after_step(batch)
        for req, position, rows in prompt_logits:
            self.choices.score_prompt(req, position, rows)
        draws = self.choices.sample(logits, sampling, masks, self._fork) if sampling else []
        now = time.perf_counter()
        self.step_stats.record(batch.num_new_tokens, now - start)
        self._last_step_s = now - start
        outputs = [self._append(req, tok, now, lp) for req, tok, lp in draws]
        if not self.scheduler.has_work:
            self.idle()
        self.step_stats.queued_prompt_tokens = self.scheduler.pending_prompt_tokens()
        return outputs

    def _fork(self, parent: Request) -> list[Request]:
        """Choices 1..n-1 of ``parent``, which has just computed its prompt (they share it)."""
        parent.forked = True
        children = []
        for i in range(1, parent.params.n):
            detokenizer = IncrementalDetokenizer(self.tokenizer, parent.params.stop,
                                                 parent.params.kept_special_ids)  # fmt: skip
            child = parent.fork_child(i, detokenizer)
            self._requests[child.request_id] = child
            if not self.scheduler.fork(parent, child, self._copy_page):
                self.scheduler.requeue(child)  # no page for its copy: it recomputes later
            children.append(child)
        return children

    def _copy_page(self, src: int, dst: int) -> None:
        if self.tp_group is not None:
            self.tp_group.copy_page(src, dst)
        copy_page(self.kv_pool, src, dst)

    def start_rank_agents(self, request: dict[str, object]) -> None:
        """Have ranks 1..N-1 start their KV transfer agents (`radixserve.transfer.group`):
        ``request`` as `radixserve.engine.tp_rank.run_call`'s "agent" reads it."""
        assert self.tp_group is not None, "no tensor-parallel ranks"
        self.tp_group.call({**request, "op": "agent", "identity": self.identity.digest})

    def set_spill_buffer(self, buffer: torch.Tensor, path: str | None) -> None:
        """Where `copy_out` copies spilled pages: a host tensor of whole pages, which
        every rank maps from the file ``path`` when there are ranks."""
        self._spill_buffer = buffer
        if self.tp_group is not None:
            assert path is not None, "a tensor-parallel worker's spill buffer is a file"
            self.tp_group.call({"op": "spill_buffer", "path": path, "shape": list(buffer.shape),
                                "dtype": str(buffer.dtype).removeprefix("torch.")})  # fmt: skip

    def copy_out(self, page_ids: list[int], slots: list[int]) -> None:
        """Pages ``page_ids`` into ``slots`` of the spill buffer, each rank its heads."""
        assert self._spill_buffer is not None, "set_spill_buffer first"
        copy_out(self.kv_pool, self.kv_shard, page_ids, self._spill_buffer, slots)
        if self.tp_group is not None:
            self.tp_group.call({"op": "spill", "pages": page_ids, "slots": slots})

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (the engine computes no more)."""
        if self.tp_group is not None:
            self.tp_group.stop()

    def _append(
        self, req: Request, token: int, now: float, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        req.output_ids.append(token)
        if req.thinking is not None:
            req.thinking.add(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        grammar_done = req.guide is not None and advance(req.guide, token)
        if req.first_token_time is None:
            req.first_token_time = now
        p = req.params
        # A stop token ends the request and, like EOS, contributes no text (OpenAI behaviour).
        is_stop_token = token in p.stop_token_ids or (
            token in self.config.eos_token_ids and not p.ignore_eos
        )
        text = "" if is_stop_token else req.detokenizer.add(token)
        reason = None
        if is_stop_token or req.detokenizer.stopped or grammar_done:
            reason = "stop"
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            if not req.detokenizer.stopped:
                text += req.detokenizer.flush()
            req.finish_time = now
            if req.lease_s is not None:  # prefill-only: keep the prompt KV for the reader
                num_pages = -(-len(req.prompt_ids) // self.page_size)
                self.leases.hold(req.request_id, req.page_ids[:num_pages], now + req.lease_s)
            self.scheduler.finish(req, reason)
            del self._requests[req.request_id]
            if all(m.status is RequestStatus.FINISHED for m in req.group):
                self._groups.pop(req.group_id, None)
        return self._output(req, [token], text, None if logprob is None else [logprob])

    def _output(
        self,
        req: Request,
        new_ids: list[int],
        text: str,
        logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        prompt_logprobs = None
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent and new_ids:
            prompt_logprobs = list(req.prompt_logprobs)
            req.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=req.group_id,
            new_token_ids=new_ids,
            new_text=text,
            finished=all(m.status is RequestStatus.FINISHED for m in req.group),
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=min(req.num_cached_tokens, len(req.prompt_ids)),  # resumed: past it
            completion_tokens=len(req.output_ids),
            ttft_ms=req.ttft_ms,
            host_cached_tokens=min(
                req.num_host_cached_tokens, req.num_cached_tokens, len(req.prompt_ids)
            ),  # fmt: skip
            disk_cached_tokens=min(
                req.num_disk_cached_tokens,
                req.num_host_cached_tokens,
                req.num_cached_tokens,
                len(req.prompt_ids),
            ),
            index=req.index,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            leased_page_ids=(
                self.leases.pages(req.request_id)
                if req.lease_s is not None and req.status is RequestStatus.FINISHED
                else None
            ),
        )

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None
    ) -> list[GenerationResult]:
        """Run prompts to completion as one continuous batch; results in prompt order
        (with ``params.n`` > 1, every choice of a prompt in index order)."""
        groups = [self._groups[self.add_request(prompt, params)] for prompt in prompts]
        while any(
            r.status is not RequestStatus.FINISHED or not r.forked for g in groups for r in g
        ):
            self.step()
        return [self._result(r) for g in groups for r in g]

    def _result(self, req: Request) -> GenerationResult:
        assert req.first_token_time is not None and req.finish_time is not None
        return GenerationResult(
            request_id=req.request_id,
            text=req.detokenizer.text,
            token_ids=list(req.output_ids),
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.num_cached_tokens,
            computed_prompt_tokens=req.num_computed_prompt_tokens,
            finish_reason=req.finish_reason or "stop",
            ttft_ms=(req.first_token_time - req.arrival_time) * 1000.0,
            e2e_ms=(req.finish_time - req.arrival_time) * 1000.0,
            index=req.index,
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=(
                list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None
            ),
        )

    def cache_view(self, query_id: str, max_nodes: int, text_tokens: int) -> CacheTreeReply:
        """The radix tree's largest nodes and the live requests with their phases, for
        the operator's view (`radixserve.engine.cache_view`)."""
        return describe(query_id, self.cache, self._requests.values(), self._host_loads,
                        self.leases.request_ids(), self.tokenizer, max_nodes, text_tokens)  # fmt: skip

    # -- the cache audit (`radixserve.engine.cache_audit`) -------------------------------

    def _make_audit(self, settings: EngineSettings) -> CacheAudit | None:
        if settings.audit_sample_rate <= 0 or self.cache is None:
            return None
        tolerance = settings.audit_tolerance or audit_tolerance(self.dtype)
        return CacheAudit(settings.audit_sample_rate, settings.audit_fail_closed,
                          settings.audit_logits_k, tolerance, self.tokenizer)  # fmt: skip

    def _cached_pages(self, req: Request) -> tuple[list[int], list[int]]:
        """The ids and hashes of the pages ``req``'s cached prefix was read from."""
        num_pages = req.num_cached_tokens // self.page_size
        tokens = req.prompt_ids[: num_pages * self.page_size]
        namespace = req.namespace or self.namespace
        return req.page_ids[:num_pages], page_hashes(tokens, self.page_size, namespace)

    def _audit_step(self) -> None:
        """The engine is idle: run one prefill chunk of the audit's shadow prefill (what a
        request arriving meanwhile may wait for, as behind any long prompt; its pages
        are free ones or evicted, never preempted), and judge it once it is computed."""
        assert self.audit is not None
        shadow = self.audit.next_shadow()
        assert shadow is not None
        need = shadow.pages_needed(self.page_size) - len(shadow.req.page_ids)
        short = need - self.allocator.num_free
        if short > 0 and (self.cache is None or self.cache.evict(short) < short):
            self.audit.skip_shadow(self.allocator)
            return
        if need > 0:
            shadow.req.page_ids.extend(self.allocator.alloc(need))
        self._take_cores()
        start = time.perf_counter()
        batch = shadow.chunk(self.scheduler.prefill_chunk_tokens)
        logits, _, _ = self.runner.run(batch)
        shadow.advance(batch.num_new_tokens[0])
        mismatch = shadow.done and self.audit.judge(logits[0], self.allocator)
        if mismatch and self.audit.fail_closed:
            self._fail_closed()
        self.audit.seconds += time.perf_counter() - start
        self._last_step_s = time.perf_counter() - start

    def _fail_closed(self) -> None:
        """Stop serving from the cache and drop every page it can let go now, none
        handed to the host tier: after a mismatch no cached page is trusted."""
        assert self.cache is not None
        self.scheduler.serve_from_cache = False
        dropped = self.cache.drop_unlocked()
        logger.error("cache audit failed closed: %d cached pages dropped, the cache serves "
                     "nothing until cleared", dropped)  # fmt: skip

    def clear_audit(self) -> bool:
        """An operator's all-clear after a failed-closed audit: drop what the cache holds
        now (pages locked at the failure have been released since) and serve from it
        again. Returns whether it had failed closed."""
        failed = not self.scheduler.serve_from_cache
        if failed and self.cache is not None:
            self.cache.drop_unlocked()
            logger.warning("cache audit cleared: the cache serves again")
        self.scheduler.serve_from_cache = True
        return failed

    def cache_stats(self) -> dict[str, int]:
        """Pool pages: used, free (of which reserved for running requests' next pages),
        references held outside the cache, and (with the cache) cached, locked,
        evictable and the locks held."""
        stats = {
            "pages_total": self.allocator.num_pages,
            "pages_used": self.allocator.num_used,
            "pages_free": self.allocator.num_free,  # reserved pages included: any request may take them
            "pages_reserved": self.allocator.num_reserved,
            "live_requests": len(self._requests),
            "leases": len(self.leases),
            "host_loads_in_flight": len(self._host_loads),
        }
        cached = self.cache.num_cached_pages if self.cache is not None else 0
        # references held by anything but the tree (requests, leases, host loads): 0 at rest
        stats["page_refs_outside_cache"] = self.allocator.num_refs - cached
        if self.cache is not None:
            stats["pages_cached"] = cached
            stats["pages_locked"] = self.cache.num_locked_pages
            stats["pages_evictable"] = self.cache.num_evictable_pages
            stats["cache_locks"] = self.cache.num_locks
            stats["radix_matches_total"] = self.cache.num_matches
        if self.audit is not None:
            stats.update(self.audit.stats())
            stats["audit_fail_closed"] = int(not self.scheduler.serve_from_cache)
        return stats
