"""A worker's LoRA adapters: what it serves by name, as of its start or its last run-time
load or unload (the engine's `LoraManager` owns them; they change only through `load` and
`unload`, the gateway's `LoraLoad` and `LoraUnload`), and each one's fingerprint, the
check that another worker's pages or a routed request were made by the same adapter."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from radixserve.engine.async_engine import AsyncEngine
from radixserve.errors import ModelLoadError, RequestError, UnknownAdapterError
from radixserve.protocol import Message
from radixserve.protocol.lora_messages import LoraAdapterInfo, LoraLoad, LoraReply, LoraUnload
from radixserve.runtime.adapters import load_adapter, unload_adapter
from radixserve.runtime.service import Peer

logger = logging.getLogger(__name__)


class WorkerLoras:
    """The adapters a worker serves, and its answers to run-time loads and unloads."""

    def __init__(
        self, name: str, engine: AsyncEngine, send_to: Callable[[Peer, Message], Awaitable[Any]],
        beat_now: Callable[[], None],
    ) -> None:  # fmt: skip
        self.name = name
        self.engine = engine
        self.send_to = send_to
        self.beat_now = beat_now
        self.served: dict[str, LoraAdapterInfo] = {}

    def adopt(self, infos: Sequence[LoraAdapterInfo]) -> None:
        self.served = {info.name: info for info in infos}

    def fingerprint(self, adapter: str) -> str:
        """The fingerprint of the adapter served as ``adapter`` ("" for the base model or
        an adapter not loaded here)."""
        info = self.served.get(adapter) if adapter else None
        return info.fingerprint if info is not None else ""

    async def load(self, peer: Peer, msg: LoraLoad) -> None:
        """The gateway's run-time load (`Engine.load_lora`)."""
        await self._change(peer, msg.query_id, msg.name, "loading",
                           lambda e: load_adapter(e, msg.name, msg.path))  # fmt: skip

    async def unload(self, peer: Peer, msg: LoraUnload) -> None:
        """The gateway's run-time unload (`Engine.unload_lora`: refused while a request
        uses the adapter)."""
        await self._change(peer, msg.query_id, msg.name, "unloading",
                           lambda e: unload_adapter(e, msg.name))  # fmt: skip

    async def _change(
        self, peer: Peer, query_id: str, name: str, doing: str,
        change: Callable[[Any], tuple[LoraAdapterInfo, ...]],
    ) -> None:  # fmt: skip
        """Run ``change`` on the engine between two steps and answer with a `LoraReply`:
        an adapter not loaded as ``not_found``, the engine's refusal as
        ``invalid_request`` (its sentence), anything else as ``internal``."""
        try:
            infos, _ = await self.engine.call(change)
        except UnknownAdapterError as exc:
            await self._reply(peer, query_id, name, "not_found", str(exc))
        except (ModelLoadError, RequestError) as exc:
            await self._reply(peer, query_id, name, "invalid_request", str(exc))
        except Exception as exc:
            logger.exception("%s: %s LoRA adapter %s failed", self.name, doing, name)
            await self._reply(peer, query_id, name, "internal", repr(exc))
        else:
            self.adopt(infos)
            await self._reply(peer, query_id, name)

    async def _reply(self, peer: Peer, query_id: str, name: str, error_type: str = "",
                     message: str = "") -> None:  # fmt: skip
        """Answer a load or unload with what this worker now serves as ``name``; the next
        heartbeat goes at once, so every peer (a decode worker routing prefills) sees it."""
        reply = LoraReply(query_id, error_type, message[:4096], self.served.get(name))
        self.beat_now()
        await self.send_to(peer, reply)
