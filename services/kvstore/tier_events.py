"""The kvstore's host and disk tiers' pages as KV events in vLLM's format.

With ``RADIXSERVE_KVSTORE_KV_EVENTS_ENDPOINT`` set, the kvstore publishes, as the
workers do for their own pools (`radixserve.runtime.kv_events`, one `KVEventPublisher`),
a ``BlockStored`` when pages enter a tier and a ``BlockRemoved`` when they leave it,
with the tier as the medium::

    medium   tier         stored when                          removed when
    "CPU"    host memory  a spill or a promotion from disk     evicted (LRU, to disk)
                          is committed
    "DISK"   disk files   a write round is committed, or the   its slot is reused, its
                          files are adopted (restart)          bytes fail a check, its
                                                               layout is let go, or the
                                                               tier turns off

Each page carries its proof (`PageProof`: namespace, parent hash, tokens), so a run of
pages that chain (each one's parent the page before it) is one ``BlockStored`` with the
parent of its first and the tokens of all, whose hashes a subscriber recomputes. The
pools call these on the kvstore's event loop; `KVEventPublisher.publish` only queues.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.cache.page_proof import PageProof
from radixserve.runtime.kv_events import KVEventPublisher, block_removed, block_stored


def _chains(
    hashes: Sequence[int], proofs: Sequence[PageProof]
) -> list[tuple[list[int], PageProof, list[int]]]:
    """``hashes`` (``proofs`` theirs) split into runs that chain: (hashes, the first's
    proof, the tokens of all)."""
    runs: list[tuple[list[int], PageProof, list[int]]] = []
    for h, proof in zip(hashes, proofs):
        if runs:
            run_hashes, first, tokens = runs[-1]
            same = proof.namespace == first.namespace and proof.page_size == first.page_size
            if same and proof.parent == run_hashes[-1]:
                run_hashes.append(h)
                tokens += proof.token_ids
                continue
        runs.append(([h], proof, proof.token_ids))
    return runs


class TierEvents:
    """Publishes what enters and leaves the kvstore's tiers (``medium`` "CPU" or "DISK")."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self.publisher = publisher

    def stored(
        self, medium: str, hashes: Sequence[int], proofs: Sequence[PageProof | None]
    ) -> None:
        """Pages ``hashes`` (``proofs`` theirs) entered the tier ``medium`` (a page
        without a proof has no tokens to publish and is left out)."""
        proved = [(h, p) for h, p in zip(hashes, proofs) if p is not None]
        for run_hashes, first, tokens in _chains([h for h, _ in proved], [p for _, p in proved]):
            event = block_stored(run_hashes, first.parent, tokens, first.page_size, medium)
            self.publisher.publish(event)

    def removed(self, medium: str, hashes: Sequence[int]) -> None:
        """Pages ``hashes`` left the tier ``medium``."""
        if hashes:
            self.publisher.publish(block_removed(list(hashes), medium))
