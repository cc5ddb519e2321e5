"""The engine: model + KV pool + scheduler, stepped by its caller; every KV page is the
cache manager's (`radixserve.engine.kv_cache_manager`), and the engine is the facade that
admits requests (locally, from a prefill worker, from the host tier) and hands out leases.

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

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch

from radixserve.cache.block_hash import hash_namespace
from radixserve.engine.admitting import Admitting
from radixserve.engine.cache_audit import make_audit
from radixserve.engine.choice_sampler import ChoiceSampler, Draw
from radixserve.engine.cores import CoreBoard
from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.device import resolve_device, resolve_dtype
from radixserve.engine.fair_share import fair_step_rows
from radixserve.engine.intake import RequestIntake
from radixserve.engine.kv_cache_manager import KVCacheManager
from radixserve.engine.model_runner import ModelRunner
from radixserve.engine.model_shard import ModelShard, copy_page, describe_plan
from radixserve.engine.operator_hooks import OperatorHooks
from radixserve.engine.outputs import GenerationResult, RequestOutput, TokenLogprob
from radixserve.engine.postprocess import append_token, generation_result, request_output
from radixserve.engine.request import Request, RequestStatus
from radixserve.engine.sampler import Sampler
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.scheduler import ScheduledBatch, Scheduler
from radixserve.engine.speculation import Speculator, verify_drafts
from radixserve.engine.spill import SpillHook
from radixserve.engine.step_stats import StepStats
from radixserve.engine.structured import GuideCompiler
from radixserve.engine.tp_calls import StartAgent
from radixserve.engine.tp_group import TPGroup, threads_per_rank
from radixserve.errors import InvalidRequestError, ModelLoadError
from radixserve.kernels.cpu.decode_attention import block_pages
from radixserve.model.checkpoint import Checkpoint, load_checkpoint
from radixserve.model.identity import ModelIdentity, checkpoint_identity
from radixserve.model.lora import LoraAdapter
from radixserve.model.lora_manager import LoraManager
from radixserve.model.tp import TPShard
from radixserve.protocol.cached_tokens import CachedTokens
from radixserve.settings import EngineSettings
from radixserve.transfer.compat import dtype_name

T = TypeVar("T")
logger = logging.getLogger(__name__)


class Engine(OperatorHooks, Admitting):
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
        self.quantization = describe_plan(shard.plan)
        self.page_size = settings.page_size
        num_pages = self.kv_pool.num_pages
        self.identity = checkpoint_identity(checkpoint, shard.plan, dtype_name(self.dtype))
        self.namespace = hash_namespace(self.identity.key, settings.cache_salt)
        # the one owner of every page; a request's pages come in the decode attention's runs
        self.kv = KVCacheManager(num_pages, self.page_size, block_pages(self.page_size),
                                 self.namespace if settings.prefix_cache else None)  # fmt: skip
        self.scheduler = Scheduler(
            self.kv, settings.max_num_batched_tokens, settings.max_num_seqs,
            settings.prefill_chunk_tokens, settings.fair_quantum_tokens,
            fair_step_rows(settings.fair_step_rows, self.device.type), settings.max_loras,
        )  # fmt: skip
        # the LoRA adapters requests may name (`lora_modules`, `load_lora`)
        self.loras = LoraManager(self.config, settings.max_loras, settings.max_lora_rank,
                                 self.dtype, self.device)  # fmt: skip
        for name, path in settings.lora_paths().items():
            self.loras.load(name, path)
        self.runner = ModelRunner.build(
            settings, shard, self.device, self.max_model_len, self.tp_group, self.loras
        )
        self.sampler = Sampler()
        eos = self.config.eos_token_ids
        self.guides = GuideCompiler(
            self.tokenizer.to_json(), self.config.vocab_size, eos[0] if eos else None
        )
        self.choices = ChoiceSampler(self.sampler, self.guides, eos, self.device)
        self.speculator = Speculator(settings.speculative_method,
                                     settings.speculative_max_draft_tokens,
                                     settings.speculative_max_batch)  # fmt: skip
        self.spill = SpillHook(self.kv, self.kv_pool, self.kv_shard, self.tp_group)
        # None when off (or without a cache): the step pays nothing
        self.audit = make_audit(settings, self.dtype, self.tokenizer) if self.kv.cache else None
        capacity = num_pages * self.page_size
        # (a function of the identity and the adapters, not a method: no cycle holds the engine)
        # adapter name → the root namespace of its pages (`UnknownAdapterError` if none)
        self.adapter_namespace = functools.partial(adapter_namespace, self.identity,
                                                   settings.cache_salt, self.loras)  # fmt: skip
        self.intake = RequestIntake(self.tokenizer, self.config.vocab_size, self.max_model_len,
                                    capacity, self.namespace, self.guides,
                                    self.adapter_namespace)  # fmt: skip
        logger.info(
            "engine ready: %s on %s/%s%s, weights %s (%.1f MiB%s), %s kernels, %d KV pages of "
            "%d tokens (%.2f GiB%s), prefix cache %s",
            self.config.name, self.device, self.dtype,
            f" x {tp.size} ranks (tensor parallel)" if tp.size > 1 else "", self.quantization,
            self.model.weight_bytes / (1 << 20), " per rank" if tp.size > 1 else "",
            attention.name, num_pages, self.page_size, self.kv_pool.size_bytes / (1 << 30),
            " per rank" if tp.size > 1 else "", "on" if self.kv.cache else "off",
        )  # fmt: skip

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        return self.intake.tokenize(prompt)

    # -- LoRA adapters ------------------------------------------------------------------

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Serve the PEFT adapter at ``path`` as ``name`` (`radixserve.model.lora`:
        ModelLoadError naming what it refuses)."""
        if self.tp_group is not None:
            raise ModelLoadError("LoRA adapters are not served with tensor parallelism (tp > 1)")
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``; refused (InvalidRequestError) while a request
        that names it is live, and `UnknownAdapterError` if it is not loaded."""
        self.loras.adapter(name)
        users = [r.group_id for r in self.intake.requests.values() if r.adapter == name]
        if users:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {len(users)} "
                                      f"request(s), e.g. {users[0]!r}; unload it when they end")  # fmt: skip
        self.loras.unload(name)

    # -- disaggregation: the decode side -----------------------------------------------

    def activate_remote(
        self,
        request_id: str,
        first_tokens: int | Sequence[int],
        cached: CachedTokens | None = None,
        first_logprobs: Sequence[TokenLogprob] = (),
        prompt_logprobs: Sequence[TokenLogprob] | None = None,
    ) -> list[RequestOutput]:
        """The reserved pages now hold the prompt's KV; continue with each choice's first
        token (one id, or n in choice order; the choices fork here) and return each
        choice's first output. ``cached`` (the prefill worker's cache hits) replaces this
        engine's own; ``first_logprobs`` (one per choice) and ``prompt_logprobs`` are the
        prefill side's, when the request asks for them."""
        req = self.intake.requests.get(request_id)
        if req is None or req.status is not RequestStatus.AWAITING_KV:
            raise InvalidRequestError(f"request {request_id!r} is not awaiting KV")
        tokens = [first_tokens] if isinstance(first_tokens, int) else list(first_tokens)
        if len(tokens) != req.params.n or len(first_logprobs) not in (0, len(tokens)):
            raise InvalidRequestError(
                f"request {request_id!r} has {req.params.n} choices; got {len(tokens)} first "
                f"tokens and {len(first_logprobs)} log-probabilities"
            )
        self.scheduler.activate_remote(req)
        if cached is not None:
            req.cached = cached
            req.num_computed_prompt_tokens = len(req.prompt_ids) - cached.total
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
        group = self.intake.groups.pop(request_id, None)
        if group is None:
            return None
        live = [m for m in group if m.status is not RequestStatus.FINISHED]
        for member in live:
            self.intake.requests.pop(member.request_id, None)
            self.speculator.forget(member)
            if member.request_id in self.kv.host_loads:  # waiting for its host read: not queued
                self.finish_host_admission(member.request_id, ok=False)
                member.status, member.finish_reason = RequestStatus.FINISHED, "abort"
                continue
            self.scheduler.finish(member, "abort")
        return self._output(live[0] if live else group[0], [], "")

    def step(self) -> list[RequestOutput]:
        self.kv.expire_leases(time.perf_counter())
        if self.audit is not None:
            if self.scheduler.has_work:  # real work first: the shadow gives its pages back
                self.audit.yield_shadow(self.kv)
            elif self.audit.has_work:
                # a chunk: what a request arriving meanwhile waits for
                chunk = self.scheduler.prefill_chunk_tokens
                spent = self.audit.run_shadow(self.kv, self._run_shadow, chunk)
                self._last_step_s = self._last_step_s if spent is None else spent
                return []
        if self.speculator.enabled:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        batch = self.scheduler.schedule()
        if batch is None:
            self.idle()
            return []
        self._take_cores()
        start = time.perf_counter()
        masks = self.choices.start_masks(batch)  # computed while the model runs
        logits, sampling, prompt_logits, drafts = self.runner.run(batch)
        if self.audit is not None:
            self.audit.observe(sampling, logits, self.page_size, self.namespace)
        self.scheduler.after_step(batch)
        for req, position, rows in prompt_logits:
            self.choices.score_prompt(req, position, rows)
        last_rows = {}
        if drafts:  # a verifying request samples its chunk's first position first
            last_rows = {r.request_id: logits[i] for i, r in enumerate(sampling) if r.draft}
            logits = torch.stack([drafts[r.request_id][0] if r.draft else logits[i]
                                  for i, r in enumerate(sampling)])  # fmt: skip
        draws = self.choices.sample(logits, sampling, masks, self._fork) if sampling else []
        now = time.perf_counter()
        self.step_stats.record(batch.num_new_tokens, now - start)
        self.speculator.cost.observe(sum(batch.num_new_tokens), now - start)
        self._last_step_s = now - start
        outputs = [self._append(req, tok, now, lp) for req, tok, lp in draws if not req.draft]
        if drafts:
            outputs += self._verify([d for d in draws if d[0].draft], drafts, last_rows, now)
        if not self.scheduler.has_work:
            self.idle()
        self.step_stats.queued_prompt_tokens = self.scheduler.pending_prompt_tokens()
        return outputs

    def _verify(self, first: list[Draw], drafts: dict[str, torch.Tensor],
                last_rows: dict[str, torch.Tensor], now: float) -> list[RequestOutput]:  # fmt: skip
        """The drafts' verification (`speculation.verify_drafts`; no request with a
        grammar drafts, so no masks): one output each."""
        done = verify_drafts(first, drafts, last_rows,
                             lambda rows, reqs: self.choices.sample(rows, reqs, dict, self._fork),
                             lambda req, token, lp: self._add(req, token, now, lp))  # fmt: skip
        for v in done:
            self.speculator.verified(v.req, v.drafted, v.accepted, len(v.tokens))
            v.req.draft = []
        return [self._output(v.req, v.tokens, v.text, v.logprobs) for v in done]

    def _fork(self, parent: Request) -> list[Request]:
        """Choices 1..n-1 of ``parent``, which has just computed its prompt (they share it)."""
        parent.forked = True
        children = []
        for i in range(1, parent.params.n):
            detokenizer = IncrementalDetokenizer(self.tokenizer, parent.params.stop,
                                                 parent.params.kept_special_ids)  # fmt: skip
            child = parent.fork_child(i, detokenizer)
            self.intake.requests[child.request_id] = child
            if not self.scheduler.fork(parent, child, self._copy_page):
                self.scheduler.requeue(child)  # no page for its copy: it recomputes later
            children.append(child)
        return children

    def _copy_page(self, src: int, dst: int) -> None:
        if self.tp_group is not None:
            self.tp_group.copy_page(src, dst)
        copy_page(self.kv_pool, src, dst)

    def start_rank_agents(self, call: StartAgent) -> None:
        """Have ranks 1..N-1 start their KV transfer agents (`radixserve.transfer.group`)
        as ``call`` says, with this engine's model identity."""
        assert self.tp_group is not None, "no tensor-parallel ranks"
        self.tp_group.call(dataclasses.replace(call, identity=self.identity.digest))

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (the engine computes no more)."""
        if self.tp_group is not None:
            self.tp_group.stop()

    def _append(
        self, req: Request, token: int, now: float, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        text = self._add(req, token, now, logprob)
        return self._output(req, [token], text, None if logprob is None else [logprob])

    def _add(self, req: Request, token: int, now: float, logprob: TokenLogprob | None) -> str:
        """Append ``token`` to ``req`` (ending it if it finishes); its text."""
        eos, max_len = self.config.eos_token_ids, self.max_model_len
        text, reason = append_token(req, token, now, logprob, eos, max_len)
        if reason is not None:
            self.speculator.finished(req)
            if req.lease_s is not None:  # prefill-only: keep the prompt KV for the reader
                num_pages = -(-len(req.prompt_ids) // self.page_size)
                self.kv.lease(req.request_id, req.page_ids[:num_pages], now + req.lease_s)
            self.scheduler.finish(req, reason)
            del self.intake.requests[req.request_id]
            if all(m.status is RequestStatus.FINISHED for m in req.group):
                self.intake.groups.pop(req.group_id, None)
        return text

    def _output(
        self, req: Request, new_ids: list[int], text: str, lps: list[TokenLogprob] | None = None
    ) -> RequestOutput:
        done = req.lease_s is not None and req.status is RequestStatus.FINISHED
        leased = self.kv.leases.pages(req.request_id) if done else None
        return request_output(req, new_ids, text, lps, leased)

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None
    ) -> list[GenerationResult]:
        """Run prompts to completion as one continuous batch; results in prompt order
        (with ``params.n`` > 1, every choice of a prompt in index order)."""
        groups = [self.intake.groups[self.add_request(prompt, params)] for prompt in prompts]
        while any(
            r.status is not RequestStatus.FINISHED or not r.forked for g in groups for r in g
        ):
            self.step()
        return [generation_result(r) for g in groups for r in g]

    def _run_shadow(self, batch: ScheduledBatch) -> torch.Tensor:
        self._take_cores()
        return self.runner.run(batch)[0]


def adapter_namespace(identity: ModelIdentity, salt: str, loras: LoraManager, name: str) -> bytes:
    """The root namespace of LoRA adapter ``name``'s pages: the model identity with the
    adapter's fingerprint (`UnknownAdapterError` if it is not loaded), under ``salt``."""
    adapted = dataclasses.replace(identity, adapter=loras.adapter(name).fingerprint)
    return hash_namespace(adapted.key, salt)
