"""LoRA adapters as services state them: `LoraAdapterInfo` (name, fingerprint, page-hash
namespace, path) from an engine, and run-time loads and unloads.

Each function runs on the engine thread (`AsyncEngine.call`), between two steps: the
engine's `LoraManager` is the one owner of what is loaded; a service keeps the snapshot
the last call returned (`radixserve.runtime.engine_client.LocalEngineClient`, a worker's
heartbeat) and refreshes it after each load or unload it makes. Its peers read a worker's
from its heartbeats (`served_by`, `holds`).
"""

from __future__ import annotations

from typing import Any, Protocol

from radixserve.protocol.lora_messages import LoraAdapterInfo
from radixserve.protocol.stats_messages import ServiceStats


class Engine(Protocol):
    """What these functions use of the engine (`radixserve.engine.engine.Engine`: the
    runtime reaches it only through `AsyncEngine.call`, and the cluster's gateway imports
    this module without torch)."""

    loras: Any  # radixserve.model.lora_manager.LoraManager

    def adapter_namespace(self, name: str) -> bytes: ...
    def load_lora(self, name: str, path: str) -> Any: ...
    def unload_lora(self, name: str) -> None: ...


def adapter_info(engine: Engine, name: str) -> LoraAdapterInfo:
    """What ``engine`` serves as adapter ``name`` (`UnknownAdapterError` if nothing)."""
    adapter = engine.loras.adapter(name)
    namespace = engine.adapter_namespace(name)
    return LoraAdapterInfo(name, adapter.fingerprint, namespace, str(adapter.path))


def adapter_infos(engine: Engine) -> tuple[LoraAdapterInfo, ...]:
    """Every adapter ``engine`` serves, by name."""
    return tuple(adapter_info(engine, name) for name in sorted(engine.loras.adapters))


def load_adapter(engine: Engine, name: str, path: str) -> tuple[LoraAdapterInfo, ...]:
    """Load the PEFT adapter at ``path`` as ``name`` (`Engine.load_lora`: ModelLoadError
    naming what it refuses); every adapter served afterwards."""
    engine.load_lora(name, path)
    return adapter_infos(engine)


def unload_adapter(engine: Engine, name: str) -> tuple[LoraAdapterInfo, ...]:
    """Stop serving ``name`` (`Engine.unload_lora`: refused while a request uses it);
    every adapter served afterwards."""
    engine.unload_lora(name)
    return adapter_infos(engine)


def served_by(stats: ServiceStats | None, name: str) -> LoraAdapterInfo | None:
    """What a worker whose latest heartbeat said ``stats`` serves as adapter ``name``
    (None: nothing, or no heartbeat yet)."""
    if stats is None:
        return None
    return next((info for info in stats.loras if info.name == name), None)


def holds(stats: ServiceStats | None, name: str, fingerprint: str) -> bool:
    """Whether that worker serves adapter ``name`` with content ``fingerprint`` (always,
    for the base model: ``name`` "")."""
    if not name:
        return True
    info = served_by(stats, name)
    return info is not None and info.fingerprint == fingerprint
