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

`GET /v1/responses/{id}/input_items` lists a response's input as OpenAI does: every
item it was made from (the conversation it continued, then its own input; not its
``instructions``), each with its id, in pages (`item_page`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.services.gateway.tenancy.tenants import DEFAULT_TENANT, Principal


@dataclass(frozen=True)
class Turn:
    """One response's own items (its input, then its output), after those of `parent`."""

    items: tuple[dict[str, Any], ...]
    parent: Turn | None = None
    num_outputs: int = 0  # how many of `items`, at the end, are its output

    def inputs(self) -> list[dict[str, Any]]:
        """The items this turn's response was made from: the conversation it continued,
        then its own input."""
        before = self.parent.conversation() if self.parent else []
        return [*before, *self.items[: len(self.items) - self.num_outputs]]

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
    tenant: str  # whose it is: only its tenant's keys (and admins) find it


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

    def put(
        self, response_id: str, body: dict[str, Any], turn: Turn, tenant: str = DEFAULT_TENANT
    ) -> None:
        """Keep a response of ``tenant``, evicting the oldest beyond the size bound."""
        self._expire()
        if self.max_entries == 0:
            return
        self._entries[response_id] = _Entry(body, turn, self._clock(), tenant)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def body(self, response_id: str, param: str, caller: Principal) -> dict[str, Any]:
        return self._get(response_id, param, caller).body

    def turn(self, response_id: str, param: str, caller: Principal) -> Turn:
        return self._get(response_id, param, caller).turn

    def delete(self, response_id: str, param: str, caller: Principal) -> None:
        self._get(response_id, param, caller)
        del self._entries[response_id]

    def _get(self, response_id: str, param: str, caller: Principal) -> _Entry:
        """The entry, if ``caller`` may see it; else the same 404 as for an id never
        stored (another tenant's responses are not revealed to exist), naming `param`
        (the request field that gave the id)."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or not caller.owns(entry.tenant):
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


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """A stored item in OpenAI's shape of an input item (messages with content parts,
    every item ``completed``)."""
    if item["type"] != "message":
        return {**item, "status": "completed"}
    kind = "output_text" if item["role"] == "assistant" else "input_text"
    part: dict[str, Any] = {"type": kind, "text": item["content"]}
    if kind == "output_text":
        part.update(annotations=[], logprobs=[])
    return {**item, "content": [part], "status": "completed"}


def item_page(
    items: list[dict[str, Any]], limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """One page of `items` (OpenAI's list object): `limit` items in `order` ("asc":
    oldest first), starting after the item of id `after`; raises `OpenAIError` naming
    ``after`` when no item has that id."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise OpenAIError(400, f"after: no input item {after!r} in this response (give "
                              "the id of an item of its list)", "after")  # fmt: skip
        start = ids.index(after) + 1
    data = [listed_item(item) for item in ordered[start : start + limit]]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + limit < len(ordered)}  # fmt: skip
