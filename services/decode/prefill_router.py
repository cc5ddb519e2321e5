"""Which prefill worker computes a prompt, decided by the decode worker alone (the
gateway routes to a decode worker and nothing else), once the engine's admission has
found the prompt's route is remote.

The kvstore's index says how many leading pages of the prompt each prefill worker holds
on device, d(w), and how many the host tier holds, h (any worker can load those). For a
prompt of P full pages::

    host_only(w) = max(0, h - d(w))                  pages w would load, not compute
    cost(w) = cache_weight * (P - d(w) - host_only(w) + host_weight * host_only(w))
            + load_weight * queued_tokens(w) / page_size

lowest wins; ties go to the less loaded, then the name. ``queued_tokens(w)`` is the
worker's own figure from its last heartbeat (`WorkerLoad.queued_tokens`) plus the prompt
tokens this process sent it since that have no answer yet (the ledger here: the only
copy in each process; the worker's heartbeat is the authority, the ledger covers the
beat it lags by). Workers with more than ``busy_tokens`` queued are skipped while any
other is under it; draining workers are never picked. The index is asked only when
more than one worker is ready; without it (the kvstore down or slow) every hit counts as
0 and routing goes by load alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from radixserve.runtime.adapters import holds
from radixserve.runtime.links import Link
from radixserve.services.decode.settings import DecodeSettings


def prefill_cost(
    num_pages: int,
    hit_pages: int,
    queued_pages: float,
    cache_weight: float,
    load_weight: float,
    host_pages: int = 0,
    host_weight: float = 1.0,
) -> float:
    """Cost of prefilling a ``num_pages``-page prompt on a worker holding ``hit_pages``
    of it on device, ``host_pages`` of it in the host tier, with ``queued_pages`` of
    prompts queued (see the module notes)."""
    host_only = max(0, host_pages - hit_pages)
    to_compute = num_pages - hit_pages - host_only + host_weight * host_only
    return cache_weight * to_compute + load_weight * queued_pages


class PrefillRouter:
    """Picks prefill workers and keeps this process's ledger of unanswered prompt tokens."""

    def __init__(self, page_size: int, settings: DecodeSettings | None = None) -> None:
        """``settings``: the ``prefill_*`` weights and threshold (default: their defaults)."""
        self.page_size = page_size
        self.settings = settings or DecodeSettings()
        self._assigned: dict[str, int] = {}  # worker -> prompt tokens sent, unanswered

    def queued_tokens(self, link: Link) -> int:
        return link.load.queued_tokens + self._assigned.get(link.name, 0)

    def pick(
        self,
        links: Sequence[Link],
        num_pages: int = 0,
        device_hits: Mapping[str, int] | None = None,
        host_pages: int = 0,
        exclude: frozenset[str] = frozenset(),
    ) -> Link | None:
        """The worker of least cost among ``links`` that are ready and not excluded;
        None if none is."""
        ready = self.ready(links, exclude)
        if not ready:
            return None
        s, hits = self.settings, device_hits or {}
        candidates = [link for link in ready if self.queued_tokens(link) <= s.prefill_busy_tokens]

        def cost(link: Link) -> tuple[float, int, str]:
            queued = self.queued_tokens(link)
            value = prefill_cost(num_pages, hits.get(link.name, 0), queued / self.page_size,
                                 s.prefill_cache_weight, s.prefill_load_weight, host_pages,
                                 s.prefill_host_hit_weight)  # fmt: skip
            return value, queued, link.name

        return min(candidates or ready, key=cost)

    @staticmethod
    def ready(
        links: Sequence[Link],
        exclude: frozenset[str] = frozenset(),
        adapter: str = "",
        fingerprint: str = "",
    ) -> list[Link]:
        """The links that take prompts now: up, not draining, not excluded, and serving
        LoRA ``adapter`` with ``fingerprint`` (as their latest heartbeat says) when given."""
        return [link for link in links if link.ready and link.name not in exclude
                and holds(link.stats, adapter, fingerprint)]  # fmt: skip

    def assign(self, name: str, tokens: int) -> None:
        """``tokens`` prompt tokens were sent to ``name``."""
        self._assigned[name] = self._assigned.get(name, 0) + tokens

    def answered(self, name: str, tokens: int) -> None:
        """A prompt of ``tokens`` sent to ``name`` was answered (or given up on)."""
        left = self._assigned.get(name, 0) - tokens
        if left > 0:
            self._assigned[name] = left
        else:
            self._assigned.pop(name, None)

    def forget(self, name: str) -> None:
        """``name`` went down or left: nothing sent there is pending any more."""
        self._assigned.pop(name, None)
