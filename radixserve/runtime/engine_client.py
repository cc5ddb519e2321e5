"""What the gateway needs from an engine: `EngineClient`, and the in-process one.

The gateway only talks to an `EngineClient`: `LocalEngineClient` wraps an `AsyncEngine`
in its process; `routing.cluster_client.ClusterClient` (ZMQ to decode workers)
implements the same interface. Clients tokenise on the gateway side, so `generate`
always gets token ids.
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from radixserve.engine.fair_share import DEFAULT_SHARE, TenantShare
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import InvalidRequestError
from radixserve.model.identity import ModelIdentity
from radixserve.model.tokenizer import Tokenizer
from radixserve.protocol.lora_messages import LoraAdapterInfo
from radixserve.protocol.view_messages import CacheTreeReply
from radixserve.runtime.adapters import adapter_infos, load_adapter, unload_adapter
from radixserve.tracing import NO_SPAN, Span

if TYPE_CHECKING:  # only the in-process client has one; the cluster gateway has no torch
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.worker_metrics import WorkerView

logger = logging.getLogger(__name__)

LOCAL_WORKER = "engine"  # the in-process engine's name where workers are listed (the explorer)


class EngineClient(abc.ABC):
    """A handle on one serving engine (local or remote)."""

    @abc.abstractmethod
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        span: Span = NO_SPAN,
        cache_scope: str = "",
        routing_key: str = "",
        share: TenantShare = DEFAULT_SHARE,
        adapter: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per engine step until one has `finished` set.
        ``span``: the request's span at the gateway (`radixserve.tracing`), under which
        a client records its own steps and keeps the spans its workers carry back.
        ``cache_scope``: whose cached KV the request may share
        (`radixserve.cache.block_hash.cache_scope`; "" = the default scope);
        ``routing_key``: requests with the same key go to the same engine while it is
        not overloaded (a hint, where there is a choice of engines); ``share``: its
        tenant, priority and weight in the engine's schedule (`radixserve.engine.fair_share`);
        ``adapter``: the LoRA adapter it runs with, one of `adapters` ("" = the base model).

        Contract: raises `RequestError` (e.g. InvalidRequestError for a prompt over the
        context) before the first output for a request that can never be served.
        Closing the iterator early (`aclose`, or garbage collection) aborts the request
        and releases everything it holds in the engine.
        """

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (text → ids, chat template)."""

    @property
    @abc.abstractmethod
    def model_name(self) -> str:
        """Name of the served model."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Context limit in tokens (prompt + output)."""

    @property
    def served_name(self) -> str:
        """The model id served by default (`served_model_id` of the checkpoint)."""
        return self.model_name

    @property
    def identity(self) -> ModelIdentity | None:
        """What computes the served pages (weights fingerprint, quantization, dtype,
        adapter); None where not known (yet)."""
        return None

    @property
    def cache_page_size(self) -> int:
        """Tokens per page the prefix cache keeps (it keeps whole pages); 0 where
        nothing is cached."""
        return 0

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """Pool and request counters: pages_total/used/free, live_requests and, with a
        prefix cache, pages_cached/locked/evictable; an in-process engine's LoRA adapter
        slots (`EngineSection`'s ``lora_*``). Cheap; safe from any thread."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the engine side; live requests are aborted. Idempotent."""

    async def start(self) -> None:  # noqa: B027 - an optional hook
        """Run once on the server's event loop before the first request (app startup);
        clients that own sockets open them here. Nothing to do by default."""

    async def shutdown(self) -> None:  # noqa: B027 - an optional hook
        """Run once on the server's event loop at app shutdown. Nothing by default."""

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Whether requests can be served now, and details for /health."""
        return True, {}

    def worker_stats(self) -> dict[str, WorkerView]:
        """Per-worker link, load and stats (name -> view) for /debug/cache, /metrics and
        the explorer; empty for an in-process engine (see `stats`)."""
        return {}

    async def cache_tree(
        self, worker: str, max_nodes: int, text_tokens: int
    ) -> CacheTreeReply | None:
        """Worker ``worker``'s radix tree (its ``max_nodes`` largest nodes, with their
        first ``text_tokens`` tokens as text when > 0) and live requests, for the
        explorer; None if there is no such worker up or it did not answer in time."""
        return None

    async def clear_cache_audit(self) -> dict[str, bool | None]:
        """An operator's all-clear for the cache audit, on every engine (worker name ->
        whether it had failed closed; None: it did not answer in time)."""
        return {}

    # -- LoRA adapters -------------------------------------------------------------------

    def adapters(self) -> Mapping[str, LoraAdapterInfo]:
        """The LoRA adapters requests may name now, by name (none by default)."""
        return {}

    async def load_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        """Serve the PEFT adapter at ``path`` (already confined by the caller) as ``name``
        on every engine; `RequestError` naming what was refused."""
        raise InvalidRequestError("this server cannot load LoRA adapters", param="lora_name")

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` on every engine (`UnknownAdapterError` if none
        serves it; refused while a request uses it)."""
        raise InvalidRequestError("this server cannot unload LoRA adapters", param="lora_name")


class LocalEngineClient(EngineClient):
    """An `AsyncEngine` in this process. Owns it: `close()` stops its thread."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._async = engine
        self._closed = False
        # the engine's adapters as of its start or the last load or unload (its LoraManager
        # owns them; they change only through this client): asked once here, between steps
        loaded: concurrent.futures.Future[tuple[LoraAdapterInfo, ...]] = concurrent.futures.Future()

        def ask(e: Any) -> None:
            try:
                loaded.set_result(adapter_infos(e))
            except Exception as exc:
                loaded.set_exception(exc)

        engine.submit(ask)
        self._adapters = {info.name: info for info in loaded.result(timeout=60)}

    def _adopt(self, called: tuple[tuple[LoraAdapterInfo, ...], object]) -> None:
        self._adapters = {info.name: info for info in called[0]}

    async def generate(  # type: ignore[override]
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        span: Span = NO_SPAN,
        cache_scope: str = "",
        routing_key: str = "",  # one engine: nothing to choose
        share: TenantShare = DEFAULT_SHARE,
        adapter: str = "",
    ) -> AsyncIterator[RequestOutput]:
        logger.debug("request %s: %d prompt tokens", request_id, len(prompt_ids))
        stream = self._async.stream(prompt_ids, params, request_id, cache_scope, share, adapter)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    @property
    def tokenizer(self) -> Tokenizer:
        return self._async.info.tokenizer

    @property
    def model_name(self) -> str:
        return self._async.info.model_name

    @property
    def served_name(self) -> str:
        return self._async.info.served_name

    @property
    def identity(self) -> ModelIdentity | None:
        return self._async.info.identity

    @property
    def max_model_len(self) -> int:
        return self._async.info.max_model_len

    @property
    def cache_page_size(self) -> int:
        info = self._async.info
        return info.page_size if info.prefix_cache else 0

    def stats(self) -> dict[str, int]:
        stats = self._async.stats()
        return {**stats.cache, **stats.lora}

    async def cache_tree(
        self, worker: str, max_nodes: int, text_tokens: int
    ) -> CacheTreeReply | None:
        if worker != LOCAL_WORKER:
            return None
        reply, _ = await self._async.call(lambda e: e.cache_view("local", max_nodes, text_tokens))
        return reply

    async def clear_cache_audit(self) -> dict[str, bool | None]:
        was_failed, _ = await self._async.call(lambda e: e.clear_audit())
        return {LOCAL_WORKER: was_failed}

    def adapters(self) -> Mapping[str, LoraAdapterInfo]:
        return self._adapters

    async def load_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        self._adopt(await self._async.call(lambda e: load_adapter(e, name, path)))
        return self._adapters[name]

    async def unload_adapter(self, name: str) -> None:
        self._adopt(await self._async.call(lambda e: unload_adapter(e, name)))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._async.close()
