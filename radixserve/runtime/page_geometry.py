"""What two processes must agree on to share KV pages by hash, checked when a link comes
up (`radixserve.runtime.links.LinkSet` refuses a worker whose `HelloAck` does not match):
`PageGeometry` for a process that knows its own (a worker: page size, model identity,
page-hash namespace, pool layout, tensor-parallel size), `LearnedGeometry` for one that
loads no weights and takes the first decode worker's (the gateway)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.model.identity import ModelIdentity
from radixserve.protocol import HelloAck
from radixserve.transfer.shards import tp_pair_error

logger = logging.getLogger(__name__)


def peer_identity(ack: HelloAck) -> ModelIdentity | None:
    """The model identity a worker's `HelloAck` states (None: an older worker states
    none); ValueError if it is not one."""
    return ModelIdentity.from_key(ack.model_identity) if ack.model_identity else None


def _readable(ack: HelloAck, page_size: int) -> tuple[str, ModelIdentity | None]:
    """Why a peer's pages cannot be shared at all (another page size, an identity that
    cannot be read; "" if they may be) and the identity it states."""
    if ack.page_size != page_size:
        return f"its KV pages hold {ack.page_size} tokens, ours {page_size}", None
    try:
        return "", peer_identity(ack)
    except ValueError as exc:
        return f"its model identity cannot be read ({exc})", None


@dataclass(frozen=True)
class PageGeometry:
    """What must match for two processes to share KV pages by hash: the page size, the
    model identity (`ModelIdentity`; None: not stated), the page-hash namespace
    (`radixserve.cache.block_hash.hash_namespace` of the identity and cache salt) and,
    between two KV pools, their layout (`PoolCompat.digest`, which covers the identity;
    "" where this side has no pool) and tensor-parallel sizes that can exchange pages
    (`tp_pair_error`; 0: no pool)."""

    page_size: int
    hash_namespace: bytes
    pool_digest: str = ""
    tp_size: int = 0
    identity: ModelIdentity | None = None

    def mismatch(self, ack: HelloAck) -> str:
        """Why a peer's `HelloAck` does not match; "" if it does."""
        refused, theirs = _readable(ack, self.page_size)
        if refused:
            return refused
        if theirs is not None and self.identity is not None and theirs != self.identity:
            return (f"its model identity is {theirs.short}, ours {self.identity.short} "
                    "(weights fingerprint/quantization/dtype: its pages are other numbers)")  # fmt: skip
        if ack.hash_namespace != self.hash_namespace:
            same = theirs is not None and theirs == self.identity
            why = "the same model identity, another cache_salt" if same else (
                "model identity or cache_salt")  # fmt: skip
            return f"its page hashes have another namespace ({why})"
        if self.pool_digest and ack.pool_digest and ack.pool_digest != self.pool_digest:
            return "its KV pool has another layout (dtype, layers, KV heads or head size)"
        if self.tp_size and ack.tp_size:
            return tp_pair_error(self.tp_size, ack.tp_size)
        return ""


class LearnedGeometry:
    """The page geometry of a process that loads no weights (the gateway): it cannot
    compute the workers' identity (their resolved quantization and dtype depend on their
    device), so it adopts the namespace and identity of the first worker of a role in
    ``learn_from`` whose `HelloAck` has its page size, calls ``on_learn(namespace,
    identity)``, and from then on refuses workers of another (`PageGeometry.mismatch`).
    Until then, workers of other roles are checked on page size only. `forget` (when no
    such worker is left up) lets the next one set it again, so a cluster rolled over to
    new weights is followed. Shared by every `LinkSet` of the process, so all agree."""

    def __init__(
        self,
        page_size: int,
        on_learn: Callable[[bytes, ModelIdentity | None], None] = lambda ns, identity: None,
        learn_from: frozenset[str] = frozenset({"decode"}),
    ) -> None:
        self.page_size = page_size
        self.known: PageGeometry | None = None
        self._on_learn = on_learn
        self._learn_from = learn_from

    @property
    def hash_namespace(self) -> bytes | None:
        return self.known.hash_namespace if self.known is not None else None

    @property
    def identity(self) -> ModelIdentity | None:
        return self.known.identity if self.known is not None else None

    def mismatch(self, ack: HelloAck) -> str:
        """As `PageGeometry.mismatch`; a matching page size sets an unknown geometry."""
        return self.known.mismatch(ack) if self.known is not None else self.learn(ack)

    def learn(self, ack: HelloAck) -> str:
        """Take ``ack``'s geometry if none is known and its role is one to learn from;
        why not, if its page size or identity cannot be taken."""
        if self.known is not None:
            return ""
        why, identity = _readable(ack, self.page_size)
        if why or ack.role not in self._learn_from:
            return why
        self.known = PageGeometry(self.page_size, ack.hash_namespace, identity=identity)
        logger.info("the workers' model identity is %s (from %s)",
                    identity.short if identity else "not stated", ack.name)  # fmt: skip
        self._on_learn(ack.hash_namespace, identity)
        return ""

    def forget(self) -> None:
        """Take the next worker's geometry (no worker it learns from is up)."""
        if self.known is not None:
            logger.info("no worker is up: the next one sets the model identity")
        self.known = None
