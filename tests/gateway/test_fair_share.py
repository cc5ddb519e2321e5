"""Fair share under overload, through a real gateway over the tiny model in process: a
tenant's short chat completes while another tenant floods the engine's running slots
(as the flooding tenant's own request it would wait behind the flood); ``priority`` on
completions, chat and Responses is bounded, defaults to the key's class and may go below
it only with an admin key (403 naming the field); a key entry's ``priority`` and
``weight`` are checked at start and reach the engine's share."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.fair_share import TenantShare
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from radixserve.services.gateway.server.errors import OpenAIError
from tests.engine.engine_helpers import TINY, make_engine
from tests.gateway.conftest import RunningServer, assert_openai_error

FLOOD = "acme-flooding-key-0123456789"
CHAT = "beta-chatting-key-0123456789"
BATCH = "batch-class-key-0123456789"
ONCALL = "oncall-class-key-0123456789"
ADMIN = "operator-admin-key-0123456789"
KEYS = [{"key": FLOOD, "tenant": "acme"}, {"key": CHAT, "tenant": "beta", "weight": 2},
        {"key": BATCH, "tenant": "batch", "priority": 10},
        {"key": ONCALL, "tenant": "oncall", "priority": -20},
        {"key": ADMIN, "tenant": "ops", "role": "admin"}]  # fmt: skip
#: 12 prompts against 4 running slots: two thirds of the flood waits
NUM_FLOOD, MAX_NUM_SEQS = 12, 4
LONG = {"model": "default", "prompt": "Count to one hundred: " * 20, "max_tokens": 48,
        "ignore_eos": True}  # fmt: skip
SHORT_CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 4}  # fmt: skip


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def crowded() -> Iterator[tuple[RunningServer, LocalEngineClient]]:
    """A gateway with keys over a tiny engine of few running slots."""
    engine = make_engine(TINY, kv_cache_memory_gib=0.05, max_num_seqs=MAX_NUM_SEQS,
                         max_num_batched_tokens=256, prefill_chunk_tokens=64)  # fmt: skip
    client = LocalEngineClient(AsyncEngine(engine))
    server = RunningServer(create_app(client, GatewaySettings(api_keys=KEYS)))
    yield server, client
    server.stop()
    client.close()


def finishing_order(url: str, client: LocalEngineClient, chat_key: str) -> list[str]:
    """Flood with ``NUM_FLOOD`` long completions as acme, then, once all are in the
    engine, send a short chat with ``chat_key``: who finished in which order."""
    done: list[str] = []

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:

            async def send(who: str, path: str, body: dict[str, Any], key: str) -> None:
                response = await http.post(path, json=body, headers=auth(key))
                assert response.status_code == 200, response.text
                done.append(who)

            flood = [asyncio.create_task(send(f"flood-{i}", "/v1/completions", LONG, FLOOD))
                     for i in range(NUM_FLOOD)]  # fmt: skip
            while client.stats()["live_requests"] < NUM_FLOOD:  # all queued in the engine
                await asyncio.sleep(0.01)
            await asyncio.gather(send("chat", "/v1/chat/completions", SHORT_CHAT, chat_key),
                                 *flood)  # fmt: skip

    asyncio.run(run())
    return done


def test_a_tenants_short_chat_completes_while_another_floods(crowded) -> None:
    server, client = crowded
    order = finishing_order(server.url, client, CHAT)
    # beta is under its share of the slots: it takes one from acme in the next step
    assert order[0] == "chat", order
    # the same chat as the flooding tenant's waits for running slots behind its flood
    order = finishing_order(server.url, client, FLOOD)
    assert order.index("chat") >= NUM_FLOOD - MAX_NUM_SEQS, order


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 2}),
     ("/v1/chat/completions", {**SHORT_CHAT, "max_tokens": 2}),
     ("/v1/responses", {"model": "default", "input": "Hi", "max_output_tokens": 2})],
)  # fmt: skip
def test_priority_is_bounded_and_only_admins_go_below_their_class(crowded, path, body) -> None:
    server, _ = crowded
    with httpx.Client(base_url=server.url, timeout=60) as http:

        def post(key: str, priority: object) -> httpx.Response:
            return http.post(path, json={**body, "priority": priority}, headers=auth(key))

        for key, priority in ((FLOOD, 0), (FLOOD, 7), (BATCH, 10), (ONCALL, -20), (ADMIN, -100)):
            assert post(key, priority).status_code == 200, (key, priority)
        for key, priority in ((FLOOD, -1), (BATCH, 9), (ONCALL, -21)):
            error = assert_openai_error(post(key, priority), 403)
            assert error["param"] == "priority" and f"priority {priority}" in error["message"]
        for priority in (101, -101, "1", 1.5, True):
            error = assert_openai_error(post(ADMIN, priority), 400)
            assert "priority" in (error["param"] or "") + error["message"]


def test_a_key_entry_sets_its_class_and_its_tenants_weight() -> None:
    keyring = GatewaySettings(api_keys=KEYS).keyring()
    batch, beta, admin = keyring.principal(BATCH), keyring.principal(CHAT), keyring.principal(ADMIN)
    assert batch is not None and beta is not None and admin is not None
    assert batch.share(None) == TenantShare(batch.tenant_id, 10, 1.0)  # its class by default
    assert batch.share(50).priority == 50
    with pytest.raises(OpenAIError) as refused:
        batch.share(-1)
    assert refused.value.status == 403 and refused.value.param == "priority"
    assert beta.share(None).weight == 2.0 and admin.share(-100).priority == -100
    # the engines see a digest of the tenant, never its name; no keys: the one tenant ""
    assert len(beta.tenant_id) == 16 and "beta" not in beta.tenant_id
    assert GatewaySettings().keyring().principal(CHAT) is None


@pytest.mark.parametrize(
    "entry",
    [{"priority": -101}, {"priority": "1"}, {"priority": 1.5}, {"weight": 0},
     {"weight": -1}, {"weight": 1e9}],
)  # fmt: skip
def test_a_key_entrys_priority_and_weight_are_bounded(entry) -> None:
    with pytest.raises(ValidationError, match="priority|weight"):
        GatewaySettings(api_keys=[{"key": FLOOD, "tenant": "acme", **entry}])


def test_a_tenants_entries_must_agree_on_its_weight() -> None:
    clash = [{"key": FLOOD, "tenant": "acme", "weight": 2}, {"key": CHAT, "tenant": "acme"},
             {"key": BATCH, "tenant": "acme", "weight": 3}]  # fmt: skip
    with pytest.raises(ValueError, match="tenant acme set weight to 2.0 and 3.0"):
        GatewaySettings(api_keys=clash).keyring()
    agreeing = GatewaySettings(api_keys=clash[:2]).keyring()
    chat = agreeing.principal(CHAT)
    assert chat is not None and chat.weight == 2.0  # set on one entry: the tenant's
