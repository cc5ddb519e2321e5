"""The messages of the kvstore's host-memory tier (each worker over its link to the
kvstore): attach, spill, lookup and lease, pages ready, release. Part of the protocol
of `radixserve.protocol.messages`, which registers them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from radixserve.protocol.fields import (
    COUNT,
    ERROR_TEXT,
    MAX_BLOB_BYTES,
    MAX_PAGE_ID,
    MAX_PAGES_PER_MESSAGE,
    NAMESPACE,
    PAGE_HASHES,
    PARENT_HASH,
    PEER_NAME,
    REQUEST_ID,
    TOKEN_IDS,
)
from radixserve.protocol.wire import (
    BoolSpec,
    BytesSpec,
    FloatSpec,
    IntSpec,
    ListSpec,
    Message,
    NestedSpec,
    WireStruct,
)
from radixserve.protocol.wire import field_spec as _spec

# --- the kvstore's host-memory tier ---------------------------------------------------

PAGE_IDS = ListSpec(IntSpec(0, MAX_PAGE_ID), MAX_PAGES_PER_MESSAGE)


@dataclass(frozen=True)
class HostAttach(Message):
    """Worker -> kvstore: join the host tier. ``metadata`` is the worker's spill buffer
    agent (`KVTransferAgent.metadata`): the kvstore reads spilled pages from it."""

    TYPE_TAG: ClassVar[str] = "host_attach"
    worker: str = field(metadata=_spec(PEER_NAME))
    generation: int = field(metadata=_spec(COUNT))
    metadata: bytes = field(metadata=_spec(BytesSpec(MAX_BLOB_BYTES)))


@dataclass(frozen=True)
class HostAttachAck(Message):
    """Kvstore -> worker: ``accepted`` with the host pool's agent ``metadata`` (the worker
    reads host pages from it), or refused with ``reason`` (no tier, other model...).
    ``disk_tier``: a lookup may read pages from the kvstore's disk tier first (the
    worker then waits for it as long as computing those pages would take)."""

    TYPE_TAG: ClassVar[str] = "host_attach_ack"
    accepted: bool = field(metadata=_spec(BoolSpec()))
    metadata: bytes = field(default=b"", metadata=_spec(BytesSpec(MAX_BLOB_BYTES)))
    num_pages: int = field(default=0, metadata=_spec(COUNT))
    reason: str = field(default="", metadata=_spec(ERROR_TEXT))
    disk_tier: bool = field(default=False, metadata=_spec(BoolSpec()))


@dataclass(frozen=True)
class SpillRun(WireStruct):
    """``num_pages`` consecutive pages of a `SpillOffer`, chained from ``parent`` (empty:
    the first of them starts a sequence) in ``namespace``: what the kvstore recomputes
    their hashes from, with their tokens."""

    num_pages: int = field(metadata=_spec(IntSpec(1, MAX_PAGES_PER_MESSAGE)))
    namespace: bytes = field(metadata=_spec(NAMESPACE))
    parent: tuple[int, ...] = field(default=(), metadata=_spec(PARENT_HASH))


@dataclass(frozen=True)
class SpillOffer(Message):
    """Worker -> kvstore: pages it evicted (or writes through), staged in its spill buffer
    at ``buffer_page_ids``, one per chained hash; the kvstore copies those it lacks.
    ``token_ids``: every page's tokens (page size each), and ``runs`` what their hashes
    chain from: the kvstore stores only pages whose hash it recomputes from them."""

    TYPE_TAG: ClassVar[str] = "spill_offer"
    spill_id: int = field(metadata=_spec(IntSpec(1)))
    page_hashes: tuple[int, ...] = field(metadata=_spec(PAGE_HASHES))
    buffer_page_ids: tuple[int, ...] = field(metadata=_spec(PAGE_IDS))
    token_ids: tuple[int, ...] = field(default=(), metadata=_spec(TOKEN_IDS))
    runs: tuple[SpillRun, ...] = field(
        default=(), metadata=_spec(ListSpec(NestedSpec(SpillRun), MAX_PAGES_PER_MESSAGE))
    )

    def invariant_error(self) -> str | None:
        if len(self.page_hashes) != len(self.buffer_page_ids):
            return (
                f"{len(self.page_hashes)} page hashes for {len(self.buffer_page_ids)} buffer pages"
            )
        if self.runs and sum(run.num_pages for run in self.runs) != len(self.page_hashes):
            return (
                f"runs of {sum(r.num_pages for r in self.runs)} pages for {len(self.page_hashes)}"
            )
        if self.page_hashes and len(self.token_ids) % len(self.page_hashes):
            return f"{len(self.token_ids)} tokens for {len(self.page_hashes)} pages"
        return None


@dataclass(frozen=True)
class SpillDone(Message):
    """Kvstore -> worker: done with spill ``spill_id``'s buffer pages (reuse them);
    ``stored`` new pages entered the host tier."""

    TYPE_TAG: ClassVar[str] = "spill_done"
    spill_id: int = field(metadata=_spec(IntSpec(1)))
    stored: int = field(default=0, metadata=_spec(COUNT))


@dataclass(frozen=True)
class HostLookup(Message):
    """Worker -> kvstore: lease the longest leading run of these chained page hashes held
    in the host tier (the pages of a prompt past the worker's own device hit). Pages on
    the disk tier are read into host memory first when that is quicker than the worker
    computing them at its measured ``prefill_tokens_per_s`` (0: not measured yet).
    ``reads_loading``: the worker can take a ``loading`` lease (`HostPagesReady`); a
    worker that does not say so gets its lease once every page is in host memory."""

    TYPE_TAG: ClassVar[str] = "host_lookup"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    page_hashes: tuple[int, ...] = field(metadata=_spec(PAGE_HASHES))
    prefill_tokens_per_s: float = field(default=0.0, metadata=_spec(FloatSpec(0.0, 1e12)))
    reads_loading: bool = field(default=False, metadata=_spec(BoolSpec()))


@dataclass(frozen=True)
class HostLease(Message):
    """Kvstore -> worker: host pages holding the first ``len(host_page_ids)`` queried
    pages, kept until `HostRelease` (or the lease expires); lease 0 = nothing found.
    ``disk_pages`` of them are read from the disk tier for this lookup. With ``loading``
    that read is still under way: only the first ``ready_pages`` may be read now, and
    `HostPagesReady` messages say when more may (the worker reads those meanwhile).
    ``token_ids``: the tokens the tier stored with those pages (page size each), which
    the worker checks against its prompt before it uses any of them."""

    TYPE_TAG: ClassVar[str] = "host_lease"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    lease_id: int = field(default=0, metadata=_spec(COUNT))
    host_page_ids: tuple[int, ...] = field(default=(), metadata=_spec(PAGE_IDS))
    disk_pages: int = field(default=0, metadata=_spec(COUNT))
    loading: bool = field(default=False, metadata=_spec(BoolSpec()))
    ready_pages: int = field(default=0, metadata=_spec(COUNT))
    token_ids: tuple[int, ...] = field(default=(), metadata=_spec(TOKEN_IDS))


@dataclass(frozen=True)
class HostPagesReady(Message):
    """Kvstore -> worker: of a ``loading`` lease, the first ``ready_pages`` hold their KV
    now; ``failed``: the page after them could not be read from disk, and no more come
    (the worker computes the prompt)."""

    TYPE_TAG: ClassVar[str] = "host_pages_ready"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    ready_pages: int = field(metadata=_spec(COUNT))
    failed: bool = field(default=False, metadata=_spec(BoolSpec()))


@dataclass(frozen=True)
class HostRelease(Message):
    """Worker -> kvstore: done reading a lease's pages."""

    TYPE_TAG: ClassVar[str] = "host_release"
    lease_id: int = field(metadata=_spec(IntSpec(1)))
