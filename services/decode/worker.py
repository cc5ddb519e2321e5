"""The decode worker: continuous batching over its own radix cache, remote prefill on demand.

For each `GenerateRequest` from the gateway:

The request is admitted once (`Worker.admit`, one engine operation: nothing before it
waits for a step):

* **Local prefill** when the prompt's uncached delta on this worker is at most
  ``local_prefill_max_tokens`` (turn N+1 of a chat whose turn N ran here), or when no
  prefill worker is up: the engine prefills and decodes; no KV moves.
* **Host tier** when the uncached part is small enough to compute here once the kvstore's
  host tier has supplied its prefix: those pages are read in first.
* **Remote prefill** otherwise: the engine reserves pages for the part of the prompt its
  cache lacks (`Engine.admit`'s remote route), a prefill worker (the gateway's pick, else the
  least loaded) computes the prompt and answers `KVReady`; this worker pulls exactly
  those pages through its transfer agent, tells the prefill worker `TransferDone` and
  continues from the first token (`Engine.activate_remote`; a request with n choices
  forks here from the n first tokens the prefill worker sampled, with their
  log-probabilities and the prompt's when asked for).

If the prefill worker fails, dies, times out (``prefill_timeout_s``) or the transfer
fails, the reserved pages are returned uncached (never decoded from) and, with
``on_transfer_failure="recompute"``, the request is prefilled locally; with ``"fail"``
the gateway gets `RequestFailed`. A prefill worker that refuses because it is draining
is no failure: the next one is tried, else the prompt is prefilled here. Outputs stream
to the gateway as `TokenChunk`s.

Prefill workers come from ``prefill_workers`` (static) and from the cluster's
membership (`services.runtime.membership`); the pick is `PrefillRouter`'s (the same cost
the gateway uses, by load alone here, since the gateway already weighed the cache).
While draining (SIGTERM) this worker refuses new `GenerateRequest`s ("draining": the
gateway sends them elsewhere) and leaves once its running requests have finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from radixserve.engine.admission import Admission
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.wire import to_chunk, to_logprob, to_params, to_spec
from radixserve.protocol import (
    Abort,
    GenerateRequest,
    KVReady,
    Message,
    PrefillRequest,
    RequestFailed,
    TransferDone,
)
from radixserve.protocol.messages import ErrorType
from radixserve.services.runtime.links import Link, LinkSet
from radixserve.services.runtime.membership import MemberView
from radixserve.services.runtime.prefill_router import PrefillRouter
from radixserve.services.runtime.service import Peer
from radixserve.services.runtime.worker import Worker, WorkerSettings
from radixserve.transfer import TransferError

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine

logger = logging.getLogger(__name__)


class DecodeSettings(WorkerSettings):
    """A decode worker's settings, from ``RADIXSERVE_DECODE_*``."""

    model_config = SettingsConfigDict(env_prefix="RADIXSERVE_DECODE_", frozen=True, extra="forbid")

    prefill_workers: list[str] = Field(
        default_factory=list,
        max_length=1024,
        description="Control addresses of the prefill workers (tcp://host:port); empty = "
        "always prefill locally. From the environment as a JSON list.",
    )
    local_prefill_max_tokens: int = Field(
        256,
        ge=0,
        description="Prefill here, moving no KV, when at most this many prompt tokens are "
        "not already cached on this worker (conditional disaggregation).",
    )
    on_transfer_failure: Literal["recompute", "fail"] = Field(
        "recompute",
        description="When remote prefill or its KV transfer fails: prefill locally, or fail "
        "the request.",
    )
    prefill_timeout_s: float = Field(
        300.0, gt=0, le=86400, description="Longest wait for a prefill worker's KVReady."
    )
    transfer_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Longest wait for one KV page transfer."
    )


class PrefillFailed(Exception):
    """Remote prefill of one request did not deliver KV."""

    def __init__(self, kind: ErrorType, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class _Pending:
    link: Link
    ready: asyncio.Future  # -> KVReady


class DecodeWorker(Worker):
    role = "decode"
    refused_while_draining = (GenerateRequest,)
    settings: DecodeSettings

    def __init__(self, settings: DecodeSettings, engine: Engine | Callable[[], Engine]) -> None:
        super().__init__(settings, engine)
        self.prefills: LinkSet | None = None
        self.view: MemberView | None = None
        self.router = PrefillRouter(self.page_size)
        self._pending: dict[str, _Pending] = {}
        self._owner: dict[str, bytes] = {}  # request id -> identity of the gateway

    async def start(self) -> None:
        s = self.settings
        assert self.context is not None
        self.prefills = LinkSet(
            self.context,
            list(s.prefill_workers),
            name=self.name,
            role="decode",
            generation=self.generation,
            interval_s=s.heartbeat_interval_s,
            peer_timeout_s=s.peer_timeout_s,
            on_message=self._from_prefill,
            on_down=self._prefill_down,
            keys=self.keys,
            page_size=self.page_size,
        )
        self.view = MemberView({"prefill": self.prefills})
        await super().start()  # the kvstore link: membership starts arriving
        self.prefills.start()

    async def stop(self) -> None:
        if self.prefills is not None:
            await self.prefills.close()
        await super().stop()

    def member_view(self) -> MemberView | None:
        return self.view

    # -- from the gateway ------------------------------------------------------------

    def handle(self, peer: Peer, msg: Message) -> None:
        if isinstance(msg, GenerateRequest):
            self._owner[msg.request_id] = peer.identity
            self.spawn(msg.request_id, self._serve(peer, msg))
        elif isinstance(msg, Abort):
            self.cancel(msg.request_id)
        else:
            super().handle(peer, msg)

    def on_peer_lost(self, peer: Peer) -> None:
        for request_id, identity in list(self._owner.items()):
            if identity == peer.identity:
                self.cancel(request_id)

    def queued_tokens(self) -> int:
        return self.engine.engine.step_stats.queued_prompt_tokens

    def stats(self) -> dict[str, int | float]:
        stats = super().stats()
        stats["prefills_up"] = len(self.prefills.ready()) if self.prefills else 0
        stats["awaiting_kv"] = len(self._pending)
        return stats

    async def _serve(self, peer: Peer, msg: GenerateRequest) -> None:
        rid = msg.request_id
        try:
            params = to_params(msg.sampling)
            ids, resume = list(msg.prompt_token_ids), list(msg.resume_token_ids)
            if resume:  # a migrated stream: computed here, after what it already streamed
                self.counters["resumed_requests_total"] += 1
                _, out = await self.admit(rid, ids, params, resume=resume)
            else:
                out = await self._begin(rid, ids, params, msg.prefill_worker)
            async for output in self.engine.outputs(rid, out):
                await self.send_to(peer, to_chunk(output))
        except PrefillFailed as exc:
            await self.send_to(peer, RequestFailed(rid, exc.kind, str(exc)[:4096]))
        except asyncio.CancelledError:
            if self.draining:  # the drain grace is over: the gateway continues it elsewhere
                with contextlib.suppress(Exception):
                    await self.send_to(peer, RequestFailed(rid, "draining", "drain grace is over"))
            raise
        except Exception as exc:
            await self.fail(peer, rid, exc)
        finally:
            self._owner.pop(rid, None)

    async def _begin(
        self, rid: str, ids: list[int], params: SamplingParams, preferred: str
    ) -> asyncio.Queue:
        """Admit the request once (`Worker.admit`: local, host tier, or remote when a
        prefill worker is ready and more than ``local_prefill_max_tokens`` would stay
        uncached) and start it; its output queue."""
        tried: set[str] = set()
        while True:
            link = self._pick_prefill(preferred, frozenset(tried))
            remote_over = self.settings.local_prefill_max_tokens if link is not None else None
            admission, out = await self.admit(rid, ids, params, remote_over=remote_over)
            if admission.route != "remote":
                self.counters["local_prefills_total"] += 1
                return out
            assert link is not None
            try:
                return await self._remote(link, rid, ids, params, admission, out)
            except PrefillFailed as exc:
                if exc.kind != "draining":
                    raise
                tried.add(link.name)  # it began draining after it was picked: next one

    # -- remote prefill --------------------------------------------------------------

    def _pick_prefill(self, preferred: str, exclude: frozenset[str]) -> Link | None:
        if self.prefills is None:
            return None
        return self.router.pick(self.prefills.links, preferred=preferred, exclude=exclude)

    async def _remote(
        self,
        link: Link,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        admission: Admission,
        out: asyncio.Queue,
    ) -> asyncio.Queue:
        """Prefill on ``link``, pull the pages, activate (no wait: the first outputs go to
        ``out``); on failure recompute here or raise."""
        dst = list(admission.page_ids)
        pending = _Pending(link, asyncio.get_running_loop().create_future())
        self._pending[rid] = pending
        self.router.assign(link.name, len(ids))
        answered = consumed = False
        try:
            await link.send(
                PrefillRequest(
                    request_id=rid,
                    token_ids=tuple(ids),
                    dst_page_ids=tuple(dst),
                    sampling=to_spec(params),
                    num_cached_tokens=admission.cached_tokens,
                )
            )
            kv: KVReady = await asyncio.wait_for(pending.ready, self.settings.prefill_timeout_s)
            self.router.answered(link.name, len(ids))
            answered = True
            await self._pull(link, kv, dst)
            consumed = True
            await self._tell(link, TransferDone(rid))
        except asyncio.CancelledError:
            await self._give_back(link, rid, consumed)
            raise
        except (PrefillFailed, TransferError, TimeoutError) as exc:
            await self._give_back(link, rid, consumed)
            if isinstance(exc, PrefillFailed) and exc.kind == "draining":
                raise  # not a failure: `_begin` tries the next prefill worker
            self.counters["remote_prefill_failures_total"] += 1
            if isinstance(exc, PrefillFailed) and exc.kind == "invalid_request":
                raise
            if self.settings.on_transfer_failure == "fail":
                kind: ErrorType = exc.kind if isinstance(exc, PrefillFailed) else "timeout"
                raise PrefillFailed(kind, f"remote prefill on {link.label} failed: {exc}") from exc
            logger.warning("%s: remote prefill of %s on %s failed (%s); recomputing locally",
                           self.name, rid, link.label, exc)  # fmt: skip
            self.counters["local_prefills_total"] += 1
            return (await self.admit(rid, ids, params))[1]
        finally:
            self._pending.pop(rid, None)
            if not answered:
                self.router.answered(link.name, len(ids))
        self.counters["remote_prefills_total"] += 1
        first = list(kv.first_token_ids)
        first_lps = [to_logprob(e) for e in kv.first_logprobs]
        prompt_lps = None
        if params.prompt_logprobs is not None:
            prompt_lps = [to_logprob(e) for e in kv.prompt_logprobs]
        self.engine.submit(
            lambda e: e.activate_remote(
                rid, first, kv.cached_tokens, kv.host_cached_tokens, first_lps, prompt_lps
            ),
            watch=rid,
        )
        return out

    async def _pull(self, link: Link, kv: KVReady, dst: list[int]) -> None:
        """Read the prefill worker's pages into ``dst``; raise `TransferError` if not done."""
        agent = self.agent
        assert agent is not None and link.ack is not None
        if len(kv.src_page_ids) != len(dst):
            raise TransferError(f"KVReady names {len(kv.src_page_ids)} pages, expected {len(dst)}")
        if not dst:
            return
        agent.add_peer(link.name, link.generation, link.ack.transfer_metadata)
        start = time.perf_counter()
        handle = agent.read_pages(
            link.name, list(kv.src_page_ids), dst, timeout_s=self.settings.transfer_timeout_s
        )
        if await agent.wait_async(handle) == "failed":
            raise TransferError(handle.error or "KV transfer failed")
        elapsed = time.perf_counter() - start
        self.counters["kv_transfers_total"] += 1
        self.counters["kv_transfer_pages_total"] += len(dst)
        self.counters["kv_transfer_bytes_total"] += len(dst) * agent.page_bytes * agent.num_regions
        self.counters["kv_transfer_seconds_total"] += elapsed

    async def _give_back(self, link: Link, rid: str, consumed: bool) -> None:
        """Free our reservation (uncached) and the prefill worker's lease or work."""
        await self.engine.call(lambda e: e.abort(rid))
        await self._tell(link, TransferDone(rid) if consumed else Abort(rid))

    @staticmethod
    async def _tell(link: Link, msg: Message) -> None:
        """Best-effort notice to a prefill worker; if it is unreachable, its lease expires."""
        with contextlib.suppress(TimeoutError):
            await link.send(msg, timeout_ms=0)

    def _from_prefill(self, link: Link, msg: Message) -> None:
        rid = getattr(msg, "request_id", None)
        pending = self._pending.get(rid) if isinstance(rid, str) else None
        if pending is None or pending.link is not link or pending.ready.done():
            if isinstance(msg, KVReady):  # we gave up on it: let the lease go now
                task = asyncio.ensure_future(
                    self._tell(link, TransferDone(msg.request_id, ok=False))
                )
                self._notices.add(task)
                task.add_done_callback(self._notices.discard)
            return
        if isinstance(msg, KVReady):
            pending.ready.set_result(msg)
        elif isinstance(msg, RequestFailed):
            pending.ready.set_exception(PrefillFailed(msg.error_type, msg.message))
        else:
            logger.warning("%s: unexpected %s from %s", self.name, msg.TYPE_TAG, link.label)

    def _prefill_down(self, link: Link, why: str) -> None:
        for pending in self._pending.values():
            if pending.link is link and not pending.ready.done():
                pending.ready.set_exception(PrefillFailed("peer_lost", f"{link.label} {why}"))
        self.router.forget(link.name)
        if self.view is not None:
            self.view.link_down("prefill", link)
