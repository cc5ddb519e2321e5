"""Chained, deterministic hashes of full KV pages.

A page's hash names the whole prefix that ends with it, not just its own tokens, so two
processes (a prefill and a decode worker, or two engines) agree on which KV a hash means
without exchanging tokens:

    namespace = hash_namespace(model_name, salt)        32-byte root seed
    h_0 = H(namespace, ROOT,    tokens[0      : P])
    h_1 = H(namespace, h_0,     tokens[P      : 2P])
    h_i = H(namespace, h_{i-1}, tokens[i*P    : (i+1)*P])

    H = first 16 bytes (big-endian) of SHA-256 over
        "radixserve.page.v2" | len(namespace) u32 BE | namespace
        | (0x00 for the first page, or 0x01 + parent u128 BE) | tokens as u32 LE

Hashes are unsigned 128-bit ints (`HASH_BYTES`): too wide for a msgpack int, they travel
as 16 big-endian bytes each (the protocol's `HashesSpec`). Only whole pages are hashed: a
trailing partial page has no hash. Never uses Python's ``hash()`` (salted per process).
Token ids must lie in ``[0, 2**32)``; others raise ``OverflowError``.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from array import array
from collections.abc import Container, Sequence

logger = logging.getLogger(__name__)

_NAMESPACE_DOMAIN = b"radixserve.namespace.v1"
_PAGE_DOMAIN = b"radixserve.page.v2"
HASH_BYTES = 16  # a page hash: the first 16 bytes of its SHA-256
_FIRST_PAGE_TAG = b"\x00"
_CHILD_PAGE_TAG = b"\x01"
# An array typecode of exactly 4 bytes ("I" on every mainstream platform).
_U32_TYPECODE = next(code for code in "IL" if array(code).itemsize == 4)


def hash_namespace(model_name: str, salt: str = "") -> bytes:
    """Return the 32-byte root seed for pages of ``model_name`` under ``salt``.

    Stable across processes, machines and Python versions; any change to either
    argument gives an unrelated seed, so tenants with different salts never share KV.
    """
    digest = hashlib.sha256(_NAMESPACE_DOMAIN)
    for part in (model_name, salt):
        encoded = part.encode("utf-8")
        digest.update(len(encoded).to_bytes(4, "big"))
        digest.update(encoded)
    return digest.digest()


def cache_scope(*, tenant: str = "", group: str = "", salt: str = "") -> str:
    """The canonical scope of a request's KV inside one model identity.

    Requests share cached pages only if their scopes are equal. Each component is
    domain-tagged and length-prefixed, so a salt can never equal a tenant or a group
    (``cache_scope(salt="tenant:x") != cache_scope(tenant="x")``). A tenant that joined
    a shared ``group`` is scoped by the group instead of its own name. All empty: the
    default scope (the engine's own namespace, what a single-tenant deployment uses).
    """
    owner = ("group", group) if group else ("tenant", tenant) if tenant else None
    parts = [owner] if owner else []
    if salt:
        parts.append(("salt", salt))
    return "".join(f"{tag}:{len(value)}:{value};" for tag, value in parts)


_SCOPE_DOMAIN = b"radixserve.scope.v1"


def scoped_namespace(root: bytes, scope: str) -> bytes:
    """The namespace of pages computed under ``scope`` (`cache_scope`) by the weights
    whose namespace is ``root`` (`hash_namespace`). The default scope ("") is ``root``
    itself, so a single-tenant deployment names its pages as before."""
    if not scope:
        return root
    digest = hashlib.sha256(_SCOPE_DOMAIN)
    digest.update(len(root).to_bytes(4, "big"))
    digest.update(root)
    digest.update(scope.encode("utf-8"))
    return digest.digest()


def page_hashes(
    token_ids: Sequence[int], page_size: int, namespace: bytes, parent: int | None = None
) -> list[int]:
    """Chained hashes of the full pages of ``token_ids``, one u128 per page.

    ``parent`` is the hash of the page just before ``token_ids[0]`` (``None`` when the
    tokens start the sequence), so hashing a sequence in pieces gives the same list as
    hashing it at once. A trailing partial page is ignored. Pure function.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    num_pages = len(token_ids) // page_size
    if num_pages == 0:
        return []
    packed = array(_U32_TYPECODE, token_ids[: num_pages * page_size])
    if sys.byteorder == "big":
        packed.byteswap()
    data = memoryview(packed.tobytes())
    base = hashlib.sha256(_PAGE_DOMAIN)
    base.update(len(namespace).to_bytes(4, "big"))
    base.update(namespace)
    step = page_size * 4
    hashes: list[int] = []
    prev = parent
    for offset in range(0, num_pages * step, step):
        page_digest = base.copy()
        if prev is None:
            page_digest.update(_FIRST_PAGE_TAG)
        else:
            page_digest.update(_CHILD_PAGE_TAG + prev.to_bytes(HASH_BYTES, "big"))
        page_digest.update(data[offset : offset + step])
        prev = int.from_bytes(page_digest.digest()[:HASH_BYTES], "big")
        hashes.append(prev)
    return hashes


def leading_held(hashes: Sequence[int], held: Container[int], limit: int | None = None) -> int:
    """How many of ``hashes`` (at most ``limit``), from the first, are in ``held``: the
    length in pages of the prompt's prefix a set of chained page hashes holds."""
    end = len(hashes) if limit is None else min(limit, len(hashes))
    count = 0
    while count < end and hashes[count] in held:
        count += 1
    return count
