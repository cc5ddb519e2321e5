"""LoRA adapters on the wire: what a worker serves, and loading or unloading one at run time.

Every worker states the adapters it has loaded in each heartbeat (`ServiceStats.loras`:
one `LoraAdapterInfo` each), so the gateway routes an adapter's request only to the
decode workers that hold it, and a decode worker its remote prefill only to the prefill
workers that hold the same adapter (same ``fingerprint``: its content). An operator's
run-time load or unload is broadcast by the gateway, one control message per worker::

    gateway --LoraLoad | LoraUnload--> worker --LoraReply--> gateway

A worker answers each with one `LoraReply`: ``error_type`` "" when done, else why not
(``invalid_request``: the engine refused it, its sentence in ``message``), with what it
holds under that name afterwards (``adapter``, None when nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from radixserve.protocol.fields import COUNT, ERROR_TEXT, MAX_ERROR_CHARS, MAX_ID_CHARS, NAMESPACE
from radixserve.protocol.wire import (
    ListSpec,
    Message,
    NestedSpec,
    OptionalSpec,
    StrSpec,
    WireStruct,
)
from radixserve.protocol.wire import field_spec as _spec

MAX_LORAS = 1024  # adapters one worker may state
# an adapter's name as requests give it ("model"); no "=" (`lora_modules` is NAME=PATH)
LORA_NAME = StrSpec(MAX_ID_CHARS, min_chars=1)
# "sha256:<64 hex digits>" (`radixserve.model.lora.LoraAdapter.fingerprint`)
FINGERPRINT = StrSpec(128)
ADAPTER_NAME = StrSpec(MAX_ID_CHARS)  # a request's LoRA adapter; "" = the base model
LORA_PATH = StrSpec(MAX_ERROR_CHARS, min_chars=1)
QUERY_ID = StrSpec(64, min_chars=1)
LORA_ERRORS = frozenset({"", "invalid_request", "not_found", "internal"})


@dataclass(frozen=True)
class LoraAdapterInfo(WireStruct):
    """One adapter a worker serves: its ``name``, content ``fingerprint``, the root page-hash
    namespace of its pages (the model identity with the fingerprint, under the cache salt:
    requests naming it are hashed in it, `radixserve.cache.block_hash.scoped_namespace`)
    and the ``path`` it was loaded from; in a heartbeat, its copies into a device slot
    (``loads``) and evictions from one so far."""

    name: str = field(metadata=_spec(LORA_NAME))
    fingerprint: str = field(metadata=_spec(FINGERPRINT))
    hash_namespace: bytes = field(default=b"", metadata=_spec(NAMESPACE))
    path: str = field(default="", metadata=_spec(StrSpec(MAX_ERROR_CHARS)))
    loads: int = field(default=0, metadata=_spec(COUNT))
    evictions: int = field(default=0, metadata=_spec(COUNT))


LORA_INFOS = ListSpec(NestedSpec(LoraAdapterInfo), MAX_LORAS)


@dataclass(frozen=True)
class LoraLoad(Message):
    """Gateway -> worker: serve the PEFT adapter at ``path`` (a directory the worker can
    read) as ``name``."""

    TYPE_TAG: ClassVar[str] = "lora_load"
    query_id: str = field(metadata=_spec(QUERY_ID))
    name: str = field(metadata=_spec(LORA_NAME))
    path: str = field(metadata=_spec(LORA_PATH))


@dataclass(frozen=True)
class LoraUnload(Message):
    """Gateway -> worker: stop serving adapter ``name`` (refused while a request uses it)."""

    TYPE_TAG: ClassVar[str] = "lora_unload"
    query_id: str = field(metadata=_spec(QUERY_ID))
    name: str = field(metadata=_spec(LORA_NAME))


@dataclass(frozen=True)
class LoraReply(Message):
    """Worker -> gateway: the outcome of a `LoraLoad` or `LoraUnload` (module notes)."""

    TYPE_TAG: ClassVar[str] = "lora_reply"
    query_id: str = field(metadata=_spec(QUERY_ID))
    error_type: str = field(default="", metadata=_spec(StrSpec(32, choices=LORA_ERRORS)))
    message: str = field(default="", metadata=_spec(ERROR_TEXT))
    adapter: LoraAdapterInfo | None = field(
        default=None, metadata=_spec(OptionalSpec(NestedSpec(LoraAdapterInfo)))
    )
