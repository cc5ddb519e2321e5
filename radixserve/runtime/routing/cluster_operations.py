"""What the gateway's operator endpoints and metrics ask of a cluster, mixed into
`ClusterClient`: its counters and each worker's view (/metrics, /debug/cache), a worker's
cache tree (the explorer), the cache audit's all-clear on every worker, and the LoRA
adapters the decode workers serve, with run-time loads and unloads on every worker up."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.errors import UnavailableError
from radixserve.protocol.lora_messages import LoraAdapterInfo
from radixserve.protocol.view_messages import CacheTreeReply
from radixserve.runtime.routing.worker_views import pool_totals, worker_view

if TYPE_CHECKING:
    from radixserve.runtime.links import Link, LinkSet
    from radixserve.runtime.routing.adapter_views import AdapterViews
    from radixserve.runtime.routing.router import DecodeRouter
    from radixserve.runtime.routing.worker_views import WorkerQuestions
    from radixserve.worker_metrics import WorkerView


class ClusterOperations:
    decodes: LinkSet | None
    prefills: LinkSet | None
    kvstore: LinkSet | None
    router: DecodeRouter
    migrations: int
    questions: WorkerQuestions
    loras: AdapterViews

    def _workers_up(self) -> list[Link]:
        """The decode and prefill workers' links that are up."""
        pools = (self.decodes, self.prefills)
        return [link for pool in pools if pool is not None for link in pool.up()]

    def stats(self) -> dict[str, int]:
        totals: dict[str, int] = {
            "gateway_migrations": self.migrations,
            "gateway_prompt_hashes": self.router.num_hashed,
        }
        if self.decodes is None or self.prefills is None:
            return totals
        return {**totals, **pool_totals(self.decodes.up() + self.prefills.up())}

    def worker_stats(self) -> dict[str, WorkerView]:
        workers: dict[str, WorkerView] = {}
        for links, role in ((self.decodes, "decode"), (self.prefills, "prefill"),
                            (self.kvstore, "kvstore")):  # fmt: skip
            for link in links.links if links is not None else ():
                router = self.router if links is self.decodes else None
                workers[link.label] = worker_view(link, role, router)
        return workers

    async def cache_tree(
        self, worker: str, max_nodes: int, text_tokens: int
    ) -> CacheTreeReply | None:
        link = next((link for link in self._workers_up() if link.label == worker), None)
        if link is None:
            return None
        return await self.questions.cache_tree(link, max_nodes, text_tokens)

    async def clear_cache_audit(self) -> dict[str, bool | None]:
        """`CacheAuditClear` to every worker up, answered in parallel."""
        return await self.questions.clear_cache_audit(self._workers_up())

    # -- LoRA adapters -------------------------------------------------------------------

    def adapters(self) -> dict[str, LoraAdapterInfo]:
        return self.loras.servable(self.decodes.ready() if self.decodes else [])

    async def load_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        """`AdapterViews.load` on every worker up (a decode worker among them)."""
        return await self.loras.load(self._lora_targets(), name, path)

    async def unload_adapter(self, name: str) -> None:
        """`AdapterViews.unload` on every worker up (a decode worker among them)."""
        await self.loras.unload(self._lora_targets(), name)

    def _lora_targets(self) -> list[Link]:
        if not (self.decodes and self.decodes.up()):
            raise UnavailableError("no decode worker is up; try again shortly")
        return self._workers_up()
