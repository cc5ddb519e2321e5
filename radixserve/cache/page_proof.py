"""What a stored KV page proves it is: its tokens and what its chained hash chains from.

A page hash (`radixserve.cache.block_hash`) names a prefix; the host and disk tiers keep,
with each page's KV, the `PageProof` its hash is recomputed from: the namespace, the
parent page's hash (None for a first page) and the page's own tokens. The kvstore stores
a spilled page only when its offered hash is the one its proof gives (`verifies`), and a
worker that loads a page compares the proof's tokens with its own prompt's before it uses
the KV (`tokens_match`). A record whose proof fails is never served.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.cache.block_hash import page_hashes

_U32_TYPECODE = next(code for code in "IL" if array(code).itemsize == 4)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as u32 little-endian (``OverflowError`` outside ``[0, 2**32)``)."""
    packed = array(_U32_TYPECODE, token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    """The token ids `pack_tokens` packed."""
    packed = array(_U32_TYPECODE)
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


@dataclass(frozen=True)
class PageProof:
    """One page's tokens (u32 LE), its parent's hash and its namespace."""

    namespace: bytes
    parent: int | None
    tokens: bytes

    @property
    def token_ids(self) -> list[int]:
        return unpack_tokens(self.tokens)

    @property
    def page_size(self) -> int:
        return len(self.tokens) // 4

    def verifies(self, page_hash: int) -> bool:
        """Whether ``page_hash`` is the hash of this page's tokens after its parent."""
        size = self.page_size
        if not size or len(self.tokens) % 4:
            return False
        return page_hashes(self.token_ids, size, self.namespace, self.parent) == [page_hash]


def chain_proofs(
    namespace: bytes, parent: int | None, token_ids: Sequence[int], hashes: Sequence[int]
) -> list[PageProof]:
    """The proofs of consecutive pages ``hashes`` of ``token_ids`` (page size each),
    chained from ``parent``: each page's parent is the hash before it."""
    if not hashes:
        return []
    size = len(token_ids) // len(hashes)
    proofs = []
    for i, page_hash in enumerate(hashes):
        tokens = pack_tokens(token_ids[i * size : (i + 1) * size])
        proofs.append(PageProof(namespace, parent, tokens))
        parent = page_hash
    return proofs


def tokens_match(proof_tokens: Sequence[int], token_ids: Sequence[int], page_size: int) -> int:
    """How many leading pages of ``proof_tokens`` (the stored pages' tokens, page size
    each) hold exactly the tokens of ``token_ids`` at the same place."""
    n = min(len(proof_tokens), len(token_ids)) // page_size
    for page in range(n):
        lo, hi = page * page_size, (page + 1) * page_size
        if list(proof_tokens[lo:hi]) != list(token_ids[lo:hi]):
            return page
    return n
