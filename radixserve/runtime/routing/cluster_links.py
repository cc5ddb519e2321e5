"""What the cluster gateway's links hear, mixed into `ClusterClient`: the decode workers'
replies put on their requests' streams (a lost worker's streams told so, to migrate), the
workers' answers to the operator's questions and adapter loads, the kvstores' member lists,
and each link coming up (the model and context it serves; run-time adapters loaded on it)
or going down."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixserve.protocol import Abort, MemberList, Message, RequestFailed, TokenChunk
from radixserve.runtime.calls import Tasks, send_quietly
from radixserve.runtime.page_geometry import LearnedGeometry, PageGeometry
from radixserve.runtime.routing.migration import Stream, WorkerLost, failure

if TYPE_CHECKING:
    from radixserve.runtime.links import Link, LinkSet
    from radixserve.runtime.membership import MemberView
    from radixserve.runtime.routing.adapter_views import AdapterViews
    from radixserve.runtime.routing.router import DecodeRouter
    from radixserve.runtime.routing.worker_views import WorkerQuestions

logger = logging.getLogger(__name__)


class ClusterLinks:
    decodes: LinkSet | None
    router: DecodeRouter
    questions: WorkerQuestions
    loras: AdapterViews
    view: MemberView | None
    pages: PageGeometry | LearnedGeometry
    _streams: dict[str, Stream]
    _background: Tasks
    _model_name: str
    _max_model_len: int

    def _kvstore_up(self, link: Link) -> None:
        if self.view is not None:
            self._background.spawn(send_quietly(link, self.view.watch()))

    def _kvstore_down(self, link: Link, _why: str = "") -> None:
        if self.view is not None:
            self.view.source_down(link.address)

    def _from_kvstore(self, link: Link, msg: Message) -> None:
        if isinstance(msg, MemberList):
            if self.view is not None:
                self.view.apply(msg, link.address)
        else:
            self._unexpected(link, msg)

    def _forget_geometry(self) -> None:
        """No decode worker is up: the next one sets the namespace again."""
        if isinstance(self.pages, LearnedGeometry) and not (self.decodes and self.decodes.up()):
            self.pages.forget()

    def _from_prefill(self, link: Link, msg: Message) -> None:
        if not self.questions.answered(msg) and not self.loras.answered(msg):
            self._unexpected(link, msg)

    def _from_decode(self, link: Link, msg: Message) -> None:
        if self.questions.answered(msg) or self.loras.answered(msg):
            return
        rid = getattr(msg, "request_id", "")
        stream = self._streams.get(rid)
        if stream is None or stream.link is not link:
            if isinstance(msg, TokenChunk) and not msg.finished:
                self._background.spawn(self._abort(link, rid))  # one we no longer wait for
            return
        if isinstance(msg, TokenChunk):
            stream.out.put_nowait(msg)
        elif isinstance(msg, RequestFailed):
            stream.out.put_nowait(failure(msg))
        else:
            self._unexpected(link, msg)

    def _decode_up(self, link: Link) -> None:
        ack = link.ack
        if ack is None:
            return
        self._worker_up(link)
        if isinstance(self.pages, LearnedGeometry):  # its restart may have unset it
            self.pages.learn(ack)
        if ack.model_name != self._model_name:
            logger.error("decode worker %s serves %r, the gateway %r", link.label,
                         ack.model_name, self._model_name)  # fmt: skip
        if ack.max_model_len:
            self._max_model_len = min(self._max_model_len, ack.max_model_len)

    def _decode_down(self, link: Link, why: str) -> None:
        self.router.forget(link.name)
        self.loras.forget(link)
        self._forget_geometry()
        for stream in self._streams.values():
            if stream.link is link:
                stream.out.put_nowait(WorkerLost(f"decode worker {link.label} {why}"))
        if self.view is not None:
            self.view.link_down("decode", link)

    def _worker_up(self, link: Link) -> None:
        """A worker (prefill or decode) came up: the adapters this gateway loaded at run
        time are loaded on it too (`AdapterViews.catch_up`)."""
        if self.loras.loaded:
            self._background.spawn(self.loras.catch_up(link))

    def _prefill_down(self, link: Link, why: str) -> None:
        self.loras.forget(link)
        if self.view is not None:
            self.view.link_down("prefill", link)

    def _unexpected(self, link: Link, msg: Message) -> None:
        logger.warning("unexpected %s from %s", msg.TYPE_TAG, link.label)

    @staticmethod
    async def _abort(link: Link, request_id: str) -> None:
        await send_quietly(link, Abort(request_id), timeout_ms=500)
