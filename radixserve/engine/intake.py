"""A request's intake: the engine's live requests (`RequestIntake`), every check a prompt
and its parameters can fail before the engine takes one in (an `InvalidRequestError` or
`CapacityError` naming what is wrong), and a migrated stream's tokens replayed into one."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from radixserve.cache.block_hash import scoped_namespace
from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.fair_share import DEFAULT_SHARE, TenantShare
from radixserve.engine.request import Request
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.structured import GuideCompiler, advance
from radixserve.errors import CapacityError, InvalidRequestError, UnknownAdapterError
from radixserve.model.tokenizer import Tokenizer


class RequestIntake:
    """The engine's live requests (engine thread): ``requests`` by internal id (choice
    i > 0: "<id>#i"), ``groups`` by the id callers know (every choice); `new` validates
    and registers one, computing nothing and holding no page."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, max_model_len: int, capacity: int,
                 namespace: bytes, guides: GuideCompiler,
                 adapter_namespace: Callable[[str], bytes] | None = None) -> None:  # fmt: skip
        """``adapter_namespace``: the root namespace of a LoRA adapter's pages, by its name
        (`UnknownAdapterError` for a name not loaded); None: no adapters are served."""
        self._tokenizer, self._vocab, self._max_model_len = tokenizer, vocab, max_model_len
        self._capacity, self._namespace, self._guides = capacity, namespace, guides
        self._adapter_namespace = adapter_namespace
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}
        self._ids = itertools.count()

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's token ids: a string encoded, ids checked against the vocabulary."""
        if len(prompt) == 0:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if isinstance(prompt, str):
            return self._tokenizer.encode(prompt)
        ids, vocab = list(prompt), self._vocab
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})"
            )
        return ids

    def new(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        cache_scope: str = "",
        share: TenantShare = DEFAULT_SHARE,
        adapter: str = "",
    ) -> Request:
        """Validate and register a request; its KV is shared only with requests of the
        same ``cache_scope`` (`radixserve.cache.block_hash.cache_scope`) and ``adapter``
        (a LoRA adapter's name, "" for the base model); ``share`` places it among other
        tenants' (`radixserve.engine.fair_share`)."""
        params = params or SamplingParams()
        namespace = self.namespace(cache_scope, adapter)  # an unknown adapter: refused first
        prompt_ids = self._validate(prompt, params, share)
        guide = self._guides.matcher(params.guide_kind, params.guide) if params.guide_kind else None
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.groups or request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        detokenizer = IncrementalDetokenizer(self._tokenizer, params.stop, params.kept_special_ids)
        req = Request(request_id, prompt_ids, params, detokenizer, cache_scope=cache_scope,
                      namespace=namespace, adapter=adapter, tenant=share.tenant,
                      priority=share.priority, weight=share.weight)  # fmt: skip
        req.guide = guide
        req.forked = params.n == 1
        self.requests[request_id] = req
        self.groups[request_id] = req.group
        return req

    def namespace(self, cache_scope: str, adapter: str) -> bytes | None:
        """The page namespace of requests of ``cache_scope`` under LoRA ``adapter`` (None:
        the cache's own); `UnknownAdapterError` for an adapter not loaded."""
        root = self._namespace
        if adapter:
            if self._adapter_namespace is None:
                raise UnknownAdapterError(f"no LoRA adapter {adapter!r} is loaded (loaded: "
                                          "none)", param="model")  # fmt: skip
            root = self._adapter_namespace(adapter)
        return scoped_namespace(root, cache_scope) if cache_scope or adapter else None

    def forget(self, req: Request) -> None:
        """Unregister a request that was never queued."""
        self.requests.pop(req.request_id, None)
        self.groups.pop(req.group_id, None)

    def _validate(
        self, prompt: str | Sequence[int], params: SamplingParams, share: TenantShare
    ) -> list[int]:
        """The prompt's token ids, once it is clear the engine can serve the request: not a
        tenant weight that is not a positive number, a prompt that leaves no room to
        generate, choices that need more than the pool's tokens of KV, or token ids
        outside the vocabulary."""
        if not (share.weight > 0 and math.isfinite(share.weight)):
            raise InvalidRequestError(f"tenant weight {share.weight} must be a positive number")
        prompt_ids, max_len, vocab = self.tokenize(prompt), self._max_model_len, self._vocab
        if len(prompt_ids) >= max_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {max_len} "
                "tokens and at least one must be left to generate"
            )
        one = min(len(prompt_ids) + params.max_tokens, max_len)
        need = one + (params.n - 1) * (one - len(prompt_ids))  # choices share the prompt
        if need > self._capacity:
            raise CapacityError(
                f"request needs up to {need} tokens of KV (prompt {len(prompt_ids)} + "
                f"{params.n} x max_tokens {params.max_tokens}) but the KV pool holds "
                f"{self._capacity} tokens; lower max_tokens or raise kv_cache_memory_gib"
            )
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("thinking_start_ids", params.thinking_start_ids),
                          ("thinking_end_ids", params.thinking_end_ids)):  # fmt: skip
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequestError(
                    f"{name} token id {bad[0]} is outside the vocabulary [0, {vocab})", param=name
                )
        return prompt_ids

    def resume(self, req: Request, tokens: Sequence[int]) -> None:
        """Continue a new ``req`` after ``tokens`` it already generated elsewhere: they
        become its output so far, fed through its detokeniser (text already sent,
        discarded here) and grammar as if sampled here. Penalties count them and seeded
        draws depend on (seed, choice, tokens so far), so the continuation is the one
        the first worker would have produced. Unregistered (and raises) if it cannot."""
        p, vocab, max_len = req.params, self._vocab, self._max_model_len
        if p.n != 1:
            self.forget(req)
            raise InvalidRequestError("only single-choice requests can resume (n = 1)")
        if (
            len(tokens) >= p.max_tokens
            or any(not 0 <= t < vocab for t in tokens)
            or (len(req.prompt_ids) + len(tokens) >= max_len)
        ):
            self.forget(req)
            raise InvalidRequestError(
                f"cannot resume after {len(tokens)} tokens (max_tokens {p.max_tokens}, "
                f"context {max_len}, vocabulary {vocab})"
            )
        for token in tokens:
            req.output_ids.append(token)
            if req.guide is not None:
                advance(req.guide, token)
            if req.thinking is not None:
                req.thinking.add(token)
            req.detokenizer.add(token)
