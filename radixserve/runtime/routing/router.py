"""Where a request goes: decode by longest cached prefix, then load.

**Decode.**
The gateway cannot see the workers' radix trees, so it keeps its own approximate view:
for each decode worker, the chained page hashes (`radixserve.cache.block_hash`) of the
token sequences it served (prompt + output), in an LRU set of bounded size. A worker
that restarts loses its cache, and `forget` drops its view with it.

Cost of sending a request to worker w (lower wins; ties go to the less loaded, then
the name)::

    cost(w) = uncached_pages(w) + load_weight * in_flight(w)

``uncached_pages`` counts the prompt's full pages after the longest prefix w is known
to hold; ``in_flight`` is the number of this gateway's requests running on w. With the
default weight a conversation stays on its worker until that worker carries
``matched_pages / load_weight`` more requests than another.

The prompt is hashed once per request (`hashes`, counted in ``num_hashed``), in the
namespace of its cache scope (`scoped_namespace(namespace, scope)`: a tenant's pages are
not another's, so neither are the views' hashes); `pick`, `started` and `finished` take
those hashes, and `finished` hashes only the pages past them (the answer). The hashes
travel on to the decode worker, which routes prefill. Before the workers' namespace is
known (``namespace`` empty) nothing is hashed: routing goes by load.

**Affinity** (``prompt_cache_key``, a routing hint, never a correctness input): a
request with an affinity key (the caller's tenant and key) goes to the worker the key's
last request went to while that worker carries at most ``affinity_slack`` more
in-flight requests than the least loaded candidate, so parallel first turns of one
conversation land together and share their prefix; otherwise it is routed as above and
the key follows it. The keys are an LRU map of bounded size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from radixserve.cache.block_hash import page_hashes, scoped_namespace

AFFINITY_SLACK = 4  # in-flight requests a key's worker may carry over the least loaded
MAX_AFFINITY_KEYS = 4096


def affinity_key(tenant: str, prompt_cache_key: str) -> str:
    """The affinity key of a request of ``tenant`` with ``prompt_cache_key`` ("": none):
    one tenant's key never meets another's."""
    return f"{len(tenant)}:{tenant}:{prompt_cache_key}" if prompt_cache_key else ""


class PrefixView:
    """An LRU set of page hashes one worker is believed to hold."""

    def __init__(self, max_pages: int) -> None:
        self._pages: OrderedDict[int, None] = OrderedDict()
        self._max = max_pages

    def __len__(self) -> int:
        return len(self._pages)

    def match(self, hashes: Sequence[int]) -> int:
        """Pages of ``hashes`` present from the start (refreshing them)."""
        n = 0
        for h in hashes:
            if h not in self._pages:
                break
            self._pages.move_to_end(h)
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._pages[h] = None
            self._pages.move_to_end(h)
        while len(self._pages) > self._max:
            self._pages.popitem(last=False)


class DecodeRouter:
    """Picks a decode worker per request and tracks what each one has seen."""

    def __init__(
        self,
        page_size: int,
        namespace: bytes,
        load_weight: float,
        max_pages_per_worker: int,
        affinity_slack: int = AFFINITY_SLACK,
        max_affinity_keys: int = MAX_AFFINITY_KEYS,
    ) -> None:
        """``namespace``: the workers' root page-hash namespace (b"": not known yet)."""
        self.page_size = page_size
        self.namespace = namespace
        self.load_weight = load_weight
        self._max_pages = max_pages_per_worker
        self._views: dict[str, PrefixView] = {}
        self.in_flight: dict[str, int] = {}
        self.num_hashed = 0  # prompts hashed
        self.affinity_slack = affinity_slack
        self._affinity: OrderedDict[str, str] = OrderedDict()  # key -> its latest worker
        self._max_keys = max_affinity_keys

    def hashes(
        self, token_ids: Sequence[int], scope: str = "", root: bytes | None = None
    ) -> list[int]:
        """The chained hashes of a prompt's full pages in cache scope ``scope`` of the
        workers' namespace, or of ``root`` (a LoRA adapter's; none while the workers'
        namespace is not known)."""
        if not self.namespace:
            return []
        self.num_hashed += 1
        namespace = scoped_namespace(root or self.namespace, scope)
        return page_hashes(token_ids, self.page_size, namespace)

    def pick(self, workers: Sequence[str], hashes: Sequence[int], affinity: str = "") -> str:
        """The worker to serve a prompt of page ``hashes`` (``workers`` must not be
        empty); with an ``affinity`` key, its worker while not overloaded (module notes)."""

        def cost(name: str) -> tuple[float, int, str]:
            view = self._views.get(name)
            matched = view.match(hashes) if view is not None else 0
            load = self.in_flight.get(name, 0)
            return (len(hashes) - matched + self.load_weight * load, load, name)

        if not affinity:
            return min(workers, key=cost)
        kept = self._affinity.get(affinity)
        least = min(self.in_flight.get(name, 0) for name in workers)
        slack = self.affinity_slack
        if kept is not None and kept in workers and self.in_flight.get(kept, 0) <= least + slack:
            chosen = kept
        else:
            chosen = min(workers, key=cost)
        self._affinity[affinity] = chosen
        self._affinity.move_to_end(affinity)
        while len(self._affinity) > self._max_keys:
            self._affinity.popitem(last=False)
        return chosen

    def started(self, worker: str, hashes: Sequence[int]) -> None:
        self.in_flight[worker] = self.in_flight.get(worker, 0) + 1
        self._view(worker).add(hashes)

    def finished(
        self,
        worker: str,
        hashes: Sequence[int],
        token_ids: Sequence[int] | None,
        scope: str = "",
        root: bytes | None = None,
    ) -> None:
        """A request of cache scope ``scope`` (under ``root``, a LoRA adapter's namespace,
        if given) whose prompt's pages hash to ``hashes`` ended; ``token_ids`` (prompt +
        output) are cached there now, if given: only the pages past ``hashes`` are hashed
        (nothing while the namespace is not known)."""
        self.in_flight[worker] = max(self.in_flight.get(worker, 0) - 1, 0)
        if token_ids and self.namespace:
            done = len(hashes)
            parent = hashes[-1] if hashes else None
            tail = token_ids[done * self.page_size :]
            namespace = scoped_namespace(root or self.namespace, scope)
            self._view(worker).add(page_hashes(tail, self.page_size, namespace, parent))

    def forget(self, worker: str) -> None:
        """``worker`` lost its cache (restart, death)."""
        self._views.pop(worker, None)

    def known_pages(self, worker: str) -> int:
        view = self._views.get(worker)
        return len(view) if view is not None else 0

    def _view(self, worker: str) -> PrefixView:
        view = self._views.get(worker)
        if view is None:
            view = self._views[worker] = PrefixView(self._max_pages)
        return view
