"""The chaos benchmark's load: concurrent multi-turn greedy chats through the gateway.

``concurrency`` clients each hold one conversation at a time (the suite's support chat,
`workload.build_multi_turn`: a shared system prompt, then user turns), send its next
turn, append the server's answer and go on; after the last turn they take the next
conversation. Even-numbered conversations stream, odd ones do not. A turn that fails is
sent again (at most ``attempts`` times, 0.5 s apart, as a user would retry), then the
conversation is given up. Every request becomes a `RequestRecord` carrying the prompt
token ids, which the caller computes with the model's own chat template
(``prompt_ids``) and checks against the gateway's ``/tokenize`` once at the start, so
the reference engine is given exactly what the gateway tokenised.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import httpx

from radixserve.bench.chaos_client import RequestRecord, send_chat
from radixserve.bench.workload import MultiTurnWorkload

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]


class ChatLoad:
    """Runs the chats until ``until_s`` (load time); `records` holds every request."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        workload: MultiTurnWorkload,
        prompt_ids: Callable[[Messages], list[int]],
        clock: Callable[[], float],
        *,
        concurrency: int,
        hang_s: float,
        attempts: int = 3,
        on_done: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self.http = http
        self.workload = workload
        self.prompt_ids = prompt_ids
        self.clock = clock
        self.concurrency = concurrency
        self.hang_s = hang_s
        self.attempts = attempts
        self.on_done = on_done
        self.records: list[RequestRecord] = []
        self.running: dict[int, RequestRecord] = {}
        self._next_conversation = itertools.count()
        self._next_request = itertools.count()
        self._until_s = 0.0

    async def run(self, until_s: float) -> None:
        """Start requests until ``until_s``; return once the last one has ended."""
        self._until_s = until_s
        await asyncio.gather(*(self._client() for _ in range(self.concurrency)))

    def streams_with_text(self) -> list[RequestRecord]:
        """Streams running now that have sent some text (candidates for a client drop)."""
        return [r for r in self.running.values() if r.stream and r.text and not r.drop.is_set()]

    async def _client(self) -> None:
        while self.clock() < self._until_s:
            await self._conversation(next(self._next_conversation))

    async def _conversation(self, index: int) -> None:
        turns = self.workload.conversations[index % len(self.workload.conversations)]
        history: Messages = [{"role": "system", "content": self.workload.system}]
        for number, turn in enumerate(turns):
            history = [*history, {"role": "user", "content": turn.user}]
            answer = await self._turn(index, number, history, turn.answer_tokens)
            if answer is None:
                return  # given up (or the load is over)
            history = [*history, {"role": "assistant", "content": answer}]

    async def _turn(
        self, conversation: int, number: int, history: Messages, max_tokens: int
    ) -> str | None:
        """The answer to the turn, retried on failure; None if it never came."""
        for _ in range(self.attempts):
            if self.clock() >= self._until_s:
                return None
            record = RequestRecord(
                request_id=next(self._next_request),
                conversation=conversation,
                turn=number,
                stream=conversation % 2 == 0,
                messages=history,
                prompt_ids=self.prompt_ids(history),
                max_tokens=max_tokens,
            )
            self.records.append(record)
            self.running[record.request_id] = record
            try:
                await send_chat(self.http, record, self.hang_s, self.clock)
            finally:
                del self.running[record.request_id]
            if self.on_done is not None:
                self.on_done(record)
            if record.outcome == "ok":
                return record.text
            logger.info("request %d (%s): %s %s", record.request_id, record.outcome,
                        record.error or "", record.detail)  # fmt: skip
            await asyncio.sleep(0.5)
        return None
