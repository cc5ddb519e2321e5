"""Real chained page hashes for the kvstore's tests, named by small ints.

The kvstore stores a spilled page only when its hash is the one its tokens give
(`radixserve.cache.page_proof`), so the tests spill real hashes: page ``n`` of one long
token sequence is ``H[n]`` (its parent ``H[n - 1]``), and `offer` carries their tokens."""

from __future__ import annotations

from collections.abc import Iterable

from radixserve.cache.block_hash import hash_namespace, page_hashes
from radixserve.cache.page_proof import PageProof, pack_tokens
from radixserve.protocol import SpillOffer
from radixserve.runtime.host_tier import spill_offer

NAMESPACE = hash_namespace("kvstore-test")


class Chain:
    """Page ``n``'s hash is ``chain[n]``; ``chain(1, 2)`` is a list of them."""

    def __init__(self, page_size: int, num_pages: int = 512, namespace: bytes = NAMESPACE) -> None:
        self.page_size, self.namespace = page_size, namespace
        self.tokens = [(7 * i + 3) % 49_999 for i in range(page_size * num_pages)]
        self.hashes = page_hashes(self.tokens, page_size, namespace)
        self._names = {h: n for n, h in enumerate(self.hashes)}

    def __getitem__(self, name: int) -> int:
        return self.hashes[name]

    def __call__(self, *names: int) -> list[int]:
        return [self.hashes[n] for n in names]

    def names(self, hashes: Iterable[int]) -> set[int]:
        return {self._names[h] for h in hashes}

    def named(self, hashes: Iterable[int]) -> list[int]:
        """The names of ``hashes``, in their order."""
        return [self._names[h] for h in hashes]

    def proof(self, name: int) -> PageProof:
        parent = self.hashes[name - 1] if name else None
        size = self.page_size
        return PageProof(
            self.namespace, parent, pack_tokens(self.tokens[name * size : (name + 1) * size])
        )

    def offer(self, spill_id: int, names: list[int], buffer_pages: list[int]) -> SpillOffer:
        """An offer of pages ``names`` staged at ``buffer_pages``, with their proofs."""
        return spill_offer(spill_id, self(*names), list(buffer_pages),
                           [self.proof(n) for n in names])  # fmt: skip
