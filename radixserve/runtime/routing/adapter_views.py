"""The gateway's view of the LoRA adapters its workers serve, and its run-time loads.

Each worker states its adapters in every heartbeat (`ServiceStats.loras`); the view of a
worker is its latest heartbeat's list, patched by the answers to the loads and unloads
this gateway sent it since that heartbeat (`LoraReply.adapter`: what it serves under the
name now), so a request right after a successful load finds the adapter without waiting
for a heartbeat. A patch is dropped with the heartbeat it patched: the next one was sent
after the answer (one socket, in order) and states the same.

An adapter may be named by requests while a decode worker that is ready serves it
(`servable`); its requests go only to decode workers serving the same content
(`holders`: the first such worker by name fixes the fingerprint, and with it the page-hash
namespace the gateway hashes the prompt in).

A run-time load or unload goes to every worker up, prefill and decode (`load`, `unload`:
one `broadcast`); each answers for itself, and the error names every one that failed and
why: an adapter stays loaded where the load succeeded (routing goes only there) and
nowhere else. The gateway keeps the adapters it loaded and did not unload (``loaded``:
name -> path, its own intent, not a copy of any worker's state) and loads them again on
a worker whose link comes up (a restart, a worker a pool adds: `catch_up`), which then
serves what the others do. (With several gateways, each keeps its own.)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence

from radixserve.errors import (
    InvalidRequestError,
    ModelLoadError,
    UnavailableError,
    UnknownAdapterError,
)
from radixserve.protocol import Message
from radixserve.protocol.lora_messages import LoraAdapterInfo, LoraLoad, LoraReply, LoraUnload
from radixserve.protocol.stats_messages import ServiceStats
from radixserve.runtime.calls import Replies
from radixserve.runtime.links import Link

logger = logging.getLogger(__name__)

LORA_REPLY_TIMEOUT_S = 60.0  # a worker's load: reading and checking the adapter's files


class AdapterViews:
    """Which adapters each worker serves (module notes); the gateway's loads and unloads."""

    def __init__(self) -> None:
        self._replies: Replies[LoraReply] = Replies()
        # link name -> (the heartbeat stats patched, name -> what it serves now / None)
        self._patches: dict[str, tuple[ServiceStats | None, dict[str, LoraAdapterInfo | None]]]
        self._patches = {}
        self.loaded: dict[str, str] = {}  # the run-time loads this gateway made: name -> path

    def of(self, link: Link) -> dict[str, LoraAdapterInfo]:
        """What ``link``'s worker serves, by name."""
        held = {info.name: info for info in link.stats.loras} if link.stats else {}
        patch = self._patches.get(link.name)
        if patch is not None and patch[0] is link.stats:
            for name, info in patch[1].items():
                if info is None:
                    held.pop(name, None)
                else:
                    held[name] = info
        return held

    def holds(self, link: Link, name: str, fingerprint: str) -> bool:
        """Whether ``link``'s worker serves adapter ``name`` as ``fingerprint`` (always for
        the base model, ``name`` "")."""
        if not name:
            return True
        info = self.of(link).get(name)
        return info is not None and info.fingerprint == fingerprint

    def servable(self, decodes: Sequence[Link]) -> dict[str, LoraAdapterInfo]:
        """The adapters requests may name: those a ready decode worker of ``decodes``
        serves (each as the first such worker by name serves it)."""
        found: dict[str, LoraAdapterInfo] = {}
        for link in sorted(decodes, key=lambda link: link.name):
            for name, info in self.of(link).items():
                found.setdefault(name, info)
        return found

    def holders(self, decodes: Sequence[Link], name: str) -> LoraAdapterInfo | None:
        """How adapter ``name`` is routed: as the first ready decode worker by name serves
        it (its fingerprint and namespace); None if none serves it."""
        return self.servable(decodes).get(name)

    async def broadcast(
        self, links: Sequence[Link], message: Callable[[str], Message], name: str
    ) -> dict[str, LoraReply | None]:
        """``message(query_id)`` (a `LoraLoad` or `LoraUnload` of adapter ``name``) to each
        of ``links``, answered in parallel: worker label -> its `LoraReply` (None: it did
        not answer in time). Each answer patches that worker's view."""

        async def ask(link: Link) -> LoraReply | None:
            query_id = uuid.uuid4().hex
            reply = await self._replies.ask(link, message(query_id), query_id,
                                            LORA_REPLY_TIMEOUT_S)  # fmt: skip
            if reply is not None:
                self._patch(link, name, reply.adapter)
            return reply

        answers = await asyncio.gather(*(ask(link) for link in links))
        return {link.label: answer for link, answer in zip(links, answers, strict=True)}

    def _patch(self, link: Link, name: str, info: LoraAdapterInfo | None) -> None:
        stats, names = self._patches.get(link.name, (None, {}))
        if stats is not link.stats:
            names = {}
        names[name] = info
        self._patches[link.name] = (link.stats, names)

    async def load(self, links: Sequence[Link], name: str, path: str) -> LoraAdapterInfo:
        """`LoraLoad` to each of ``links``: what the first serves. A worker that fails is
        named, with why, in the error: `ModelLoadError` (a 400) when every one refused
        the adapter, else `UnavailableError` (a 503) saying where it was loaded."""
        replies = await self.broadcast(
            links, functools.partial(LoraLoad, name=name, path=path), name
        )
        loaded = [r.adapter for r in replies.values()
                  if r is not None and r.adapter is not None and not r.error_type]  # fmt: skip
        if loaded:  # served somewhere: loaded again on a worker that comes up
            self.loaded[name] = path
        failed = _failures(replies)
        if failed and all(r is not None and r.error_type == "invalid_request"
                          for r in replies.values()):  # fmt: skip
            raise ModelLoadError(f"no worker loaded LoRA adapter {name!r}: {failed}")
        if failed:
            done = ", ".join(label for label, r in replies.items() if r and not r.error_type)
            raise UnavailableError(f"LoRA adapter {name!r} was loaded on {done or 'no worker'} "
                                   f"but not on every worker: {failed}")  # fmt: skip
        return loaded[0]

    async def unload(self, links: Sequence[Link], name: str) -> None:
        """`LoraUnload` to each of ``links``: `UnknownAdapterError` if none served it,
        `InvalidRequestError` naming each worker where a request still uses it (there it
        stays), `UnavailableError` naming those that did not answer."""
        replies = await self.broadcast(links, lambda query_id: LoraUnload(query_id, name), name)
        kinds = {r.error_type if r is not None else "timeout" for r in replies.values()}
        if "invalid_request" not in kinds:  # not in use: not loaded again on a worker up
            self.loaded.pop(name, None)
        if kinds == {"not_found"}:
            raise UnknownAdapterError(f"no worker serves LoRA adapter {name!r}", param="lora_name")
        busy = {label: r for label, r in replies.items()
                if r is not None and r.error_type == "invalid_request"}  # fmt: skip
        if busy:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use: {_failures(busy)}",
                                      param="lora_name")  # fmt: skip
        failed = _failures({label: r for label, r in replies.items()
                            if r is None or r.error_type not in ("", "not_found")})  # fmt: skip
        if failed:
            raise UnavailableError(f"LoRA adapter {name!r} was not unloaded everywhere: {failed}")

    async def catch_up(self, link: Link) -> None:
        """Load on ``link``'s worker, just up, each adapter this gateway loaded at run
        time (one it already serves answers "already loaded": nothing is lost)."""
        for name, path in list(self.loaded.items()):
            load = functools.partial(LoraLoad, name=name, path=path)
            answers = await self.broadcast([link], load, name)
            reply = answers[link.label]
            if reply is None or (reply.error_type and reply.adapter is None):
                why = reply.message if reply is not None else "no answer"
                logger.warning("%s did not load LoRA adapter %s again: %s", link.label, name, why)

    def answered(self, msg: Message) -> bool:
        """Whether ``msg`` answers a load or unload; it is then handed over."""
        if not isinstance(msg, LoraReply):
            return False
        self._replies.answer(msg.query_id, msg)
        return True

    def forget(self, link: Link) -> None:
        """``link``'s worker is down: what it served is stated again when it is back."""
        self._patches.pop(link.name, None)


def _failures(replies: Mapping[str, LoraReply | None]) -> str:
    """Each worker whose answer to a load or unload is a failure, and why."""
    return "; ".join(f"{label}: {reply.message if reply is not None else 'no answer'}"
                     for label, reply in sorted(replies.items())
                     if reply is None or reply.error_type)  # fmt: skip
