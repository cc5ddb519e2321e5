"""PageProof: a page's tokens and what its hash chains from prove the hash, and nothing
else does; tokens_match finds the first stored page whose tokens differ from a prompt's."""

from __future__ import annotations

from radixserve.cache.block_hash import hash_namespace, page_hashes
from radixserve.cache.page_proof import (
    PageProof,
    chain_proofs,
    pack_tokens,
    tokens_match,
    unpack_tokens,
)

NAMESPACE = hash_namespace("m")
TOKENS = [5, 6, 7, 8, 9, 10, 11, 12, 2**32 - 1, 0, 3, 4]


def test_the_proofs_of_a_chain_prove_its_hashes_and_only_them() -> None:
    hashes = page_hashes(TOKENS, 4, NAMESPACE)
    proofs = chain_proofs(NAMESPACE, None, TOKENS, hashes)
    assert [p.parent for p in proofs] == [None, hashes[0], hashes[1]]
    assert all(p.verifies(h) for p, h in zip(proofs, hashes, strict=True))
    assert unpack_tokens(proofs[2].tokens) == TOKENS[8:] and proofs[2].page_size == 4
    # another token, parent, namespace or hash: no proof
    first = proofs[0]
    assert not PageProof(NAMESPACE, None, pack_tokens([5, 6, 7, 9])).verifies(hashes[0])
    assert not PageProof(NAMESPACE, 0, first.tokens).verifies(hashes[0])
    assert not PageProof(hash_namespace("other"), None, first.tokens).verifies(hashes[0])
    assert not first.verifies(hashes[1])
    assert not PageProof(NAMESPACE, None, b"").verifies(hashes[0])


def test_tokens_match_counts_the_leading_pages_that_agree() -> None:
    assert tokens_match(TOKENS, TOKENS, 4) == 3
    other = [*TOKENS[:5], 99, *TOKENS[6:]]
    assert tokens_match(other, TOKENS, 4) == 1
    assert tokens_match(TOKENS[:8], TOKENS, 4) == 2  # fewer stored pages than asked
    assert tokens_match((), TOKENS, 4) == 0
