"""The Responses API's stored responses: what `GET /v1/responses/{id}` returns and what
``previous_response_id`` continues.

Bounded two ways (gateway settings): at most ``response_store_size`` entries, the
oldest evicted first when a new one comes, and each kept ``response_store_ttl_s``
seconds after it was stored. The gateway process owns the store: with several gateway
processes a response lives in the one that made it.

A conversation is a chain of `Turn` nodes (a turn's own input and output items, and
the turn it continued), shared by the responses that continue it, so a long agent loop
keeps each item once however many of its responses are stored. A response continues
its whole conversation even after the earlier responses are evicted (its chain holds
them); evicting it releases whatever no stored response still reaches.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.services.gateway.errors import OpenAIError


@dataclass(frozen=True)
class Turn:
    """One response's own items (its input, then its output), after those of `parent`."""

    items: tuple[dict[str, Any], ...]
    parent: Turn | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """Every item of the conversation up to and including this turn, in order."""
        chain: list[Turn] = []
        turn: Turn | None = self
        while turn is not None:
            chain.append(turn)
            turn = turn.parent
        return [item for t in reversed(chain) for item in t.items]


@dataclass(frozen=True)
class _Entry:
    body: dict[str, Any]  # the response object as returned
    turn: Turn
    stored_at: float


class ResponseStore:
    """Stored responses by id, oldest first."""

    def __init__(
        self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, body: dict[str, Any], turn: Turn) -> None:
        """Keep a response, evicting the oldest beyond the size bound."""
        self._expire()
        if self.max_entries == 0:
            return
        self._entries[response_id] = _Entry(body, turn, self._clock())
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def body(self, response_id: str, param: str) -> dict[str, Any]:
        return self._get(response_id, param).body

    def turn(self, response_id: str, param: str) -> Turn:
        return self._get(response_id, param).turn

    def delete(self, response_id: str, param: str) -> None:
        self._get(response_id, param)
        del self._entries[response_id]

    def _get(self, response_id: str, param: str) -> _Entry:
        """The entry, or a 404 naming `param` (the request field that gave the id)."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            raise OpenAIError(
                404,
                f"{param}: no stored response {response_id!r}. Responses are kept "
                f"{self.ttl_s:g} s (the {self.max_entries} newest at most) and only "
                "when created with store true (the default)",
                param,
            )
        return entry

    def _expire(self) -> None:
        """Drop the entries past their TTL (they are oldest first)."""
        deadline = self._clock() - self.ttl_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at > deadline:
                return
            self._entries.popitem(last=False)
