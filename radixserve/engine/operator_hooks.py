"""An engine's operator hooks, mixed into `Engine`: the cache tree for the explorer, the
cache audit's all-clear, the pool's counters and integrity check, and the cache and the
allocator for tests, benchmarks and listeners. They read the engine's cache manager,
intake and audit; none of them steps the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.engine.cache_view import describe

if TYPE_CHECKING:
    from radixserve.cache.page_allocator import PageAllocator
    from radixserve.cache.radix_cache import RadixCache
    from radixserve.engine.cache_audit import CacheAudit
    from radixserve.engine.intake import RequestIntake
    from radixserve.engine.kv_cache_manager import KVCacheManager
    from radixserve.model.tokenizer import Tokenizer
    from radixserve.protocol.view_messages import CacheTreeReply


class OperatorHooks:
    kv: KVCacheManager
    intake: RequestIntake
    tokenizer: Tokenizer
    audit: CacheAudit | None

    def cache_view(self, query_id: str, max_nodes: int, text_tokens: int) -> CacheTreeReply:
        """The radix tree's largest nodes and the live requests with their phases, for
        the operator's view (`radixserve.engine.cache_view`)."""
        return describe(query_id, self.kv, self.intake.requests.values(), self.tokenizer, max_nodes,
                        text_tokens)  # fmt: skip

    def clear_audit(self) -> bool:
        """An operator's all-clear after a failed-closed audit: drop what the cache holds
        now (pages locked at the failure have been released since) and serve from it
        again. Returns whether it had failed closed."""
        return self.kv.trust_again()

    def cache_stats(self) -> dict[str, int]:
        """The pool's pages (`KVCacheManager.stats`), the live requests and the audit's."""
        stats = self.kv.stats()
        stats["live_requests"] = len(self.intake.requests)
        if self.audit is not None:
            stats.update(self.audit.stats())
            stats["audit_fail_closed"] = int(not self.kv.serve_from_cache)
        return stats

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless every page is accounted for by the live
        requests, the audit's shadow, the leases, the host loads and the cache."""
        shadow = self.audit.shadow if self.audit is not None else None
        self.kv.check_integrity([*self.intake.requests.values(), *([shadow.req] if shadow else [])])

    @property
    def allocator(self) -> PageAllocator:
        """The pool's page ids (tests and benchmarks fill pages of their own)."""
        return self.kv.allocator

    @property
    def cache(self) -> RadixCache | None:
        """The prefix cache (tests, listeners and the engine info read it)."""
        return self.kv.cache
