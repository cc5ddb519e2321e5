"""Peer page reads on the wire: one worker reads cached pages another worker holds.

The kvstore's index says which worker holds how long a prefix of a prompt's page hashes
(`IndexQuery`); a worker missing that prefix asks the holder to lend it the pages past
its own device hit and reads them through its transfer agent, as a decode worker reads a
prefill worker's::

    reader --PeerRead--> owner --PeerPages | RequestFailed--> reader
    reader (reads the pages) --TransferDone--> owner                (lease release)

The owner finds the pages by the prompt's *tokens* in its own radix cache, in the
namespace of the request's cache scope and LoRA adapter, so what it lends is what those
tokens computed under its weights (the link's handshake checked they are the reader's);
it may lend fewer pages than asked (evicted since the index heard of them), none at all,
or refuse (`RequestFailed`: draining for good, another adapter). Lent pages stay the
owner's until the reader's `TransferDone` or ``lease_ms`` after the reply was sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from radixserve.protocol.fields import (
    CACHE_SCOPE,
    COUNT,
    DURATION_MS,
    MAX_PAGE_ID,
    MAX_PAGES_PER_MESSAGE,
    PROMPT_IDS,
    REQUEST_ID,
)
from radixserve.protocol.lora_messages import ADAPTER_NAME, FINGERPRINT
from radixserve.protocol.wire import IntSpec, ListSpec, Message
from radixserve.protocol.wire import field_spec as _spec


@dataclass(frozen=True)
class PeerRead(Message):
    """Reader -> owner: lend me the pages ``first_page`` .. ``first_page + num_pages`` of
    the cached prefix of ``token_ids`` (in the namespace of ``cache_scope`` and
    ``adapter``, whose content the reader's is ``adapter_fingerprint``)."""

    TYPE_TAG: ClassVar[str] = "peer_read"
    read_id: str = field(metadata=_spec(REQUEST_ID))
    token_ids: tuple[int, ...] = field(metadata=_spec(PROMPT_IDS))
    first_page: int = field(default=0, metadata=_spec(COUNT))
    num_pages: int = field(default=0, metadata=_spec(COUNT))
    cache_scope: str = field(default="", metadata=_spec(CACHE_SCOPE))
    adapter: str = field(default="", metadata=_spec(ADAPTER_NAME))
    adapter_fingerprint: str = field(default="", metadata=_spec(FINGERPRINT))


@dataclass(frozen=True)
class PeerPages(Message):
    """Owner -> reader: the owner's page ids of the leading pages it holds of those asked
    (maybe fewer, maybe none), lent to the reader for ``lease_ms`` from now."""

    TYPE_TAG: ClassVar[str] = "peer_pages"
    read_id: str = field(metadata=_spec(REQUEST_ID))
    src_page_ids: tuple[int, ...] = field(
        default=(), metadata=_spec(ListSpec(IntSpec(0, MAX_PAGE_ID), MAX_PAGES_PER_MESSAGE))
    )
    lease_ms: float = field(default=0.0, metadata=_spec(DURATION_MS))
