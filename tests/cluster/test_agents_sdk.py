"""The OpenAI Agents SDK (``openai-agents``, unmodified) runs an agent with two function
tools to completion through `radixserve up`'s processes (the ``default-tiny`` cluster:
gateway, prefill and decode workers; the tiny random model, as the subject is the API
an agent framework speaks, not the answers), once through the Responses API
(`OpenAIResponsesModel`; also with the SDK's ``auto_previous_response_id``, which
chains the turns through the gateway's response store) and once through chat
completions (`OpenAIChatCompletionsModel`), each with an ``AsyncOpenAI`` client on the
gateway. Tracing export is off and every socket the test process opens must be on
loopback.

The clerk agent asks with ``tool_choice="required"`` at temperature 0, so the gateway's
grammar makes even a random model's call valid. Its second tool is enabled (the SDK's
``is_enabled``) only once the first has run, so turn one can call only ``find_order``
and turn two only ``order_status``, and `StopAtTools` ends the run with the status.
A second agent then answers from that whole history in a streamed run, with a
structured ``output_type`` whose grammar ends the reply. Each tool must have been
called once with the arguments the model sent, valid against its schema; the gateway's
request log must list exactly the SDK's model calls, with their token counts, and its
/metrics must count them."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema
import pytest
from agents import (
    Agent,
    AgentBase,
    FunctionTool,
    ModelResponse,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunContextWrapper,
    Runner,
    RunResult,
    RunResultStreaming,
    StopAtTools,
    function_tool,
    set_tracing_disabled,
)
from agents.models.fake_id import FAKE_RESPONSES_ID
from openai import AsyncOpenAI
from openai.types.responses import ResponseFunctionToolCall
from pydantic import BaseModel

from tests.cluster.cluster_helpers import TestCluster, metric_value

SHARED_CLUSTER = "default-tiny"  # shared with other modules: tests/cluster/conftest.py
SHIPPED = "shipped"


@dataclass
class Ledger:
    """The run's context: every tool call as (tool name, the arguments it received)."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def called(self, name: str) -> bool:
        return any(n == name for n, _ in self.calls)


def _before_the_order(ctx: RunContextWrapper[Ledger], agent: AgentBase[Any]) -> bool:
    return not ctx.context.called("find_order")


def _after_the_order(ctx: RunContextWrapper[Ledger], agent: AgentBase[Any]) -> bool:
    return ctx.context.called("find_order")


@function_tool(is_enabled=_before_the_order)
def find_order(ctx: RunContextWrapper[Ledger], customer: Literal["ada", "bob"]) -> str:
    """The number of a customer's last order."""
    ctx.context.calls.append(("find_order", {"customer": customer}))
    return "Order 7. Call order_status with this number next."


@function_tool(is_enabled=_after_the_order)
def order_status(ctx: RunContextWrapper[Ledger], order_id: int) -> str:
    """Where an order is."""
    ctx.context.calls.append(("order_status", {"order_id": order_id}))
    return SHIPPED


TOOLS: dict[str, FunctionTool] = {t.name: t for t in (find_order, order_status)}


class Answer(BaseModel):
    order_id: int
    status: Literal["shipped", "pending", "lost"]


def _agents(model: OpenAIResponsesModel | OpenAIChatCompletionsModel) -> tuple[Agent, Agent]:
    clerk = Agent[Ledger](
        name="clerk",
        instructions="You are a shop clerk. Look the order up, then its status.",
        model=model,
        tools=list(TOOLS.values()),
        # every turn must call the one tool enabled then; the run stops at the second
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
        reset_tool_choice=False,
        tool_use_behavior=StopAtTools(stop_at_tool_names=["order_status"]),
    )
    writer = Agent[Ledger](
        name="writer",
        instructions="Report the order's status.",
        model=model,
        output_type=Answer,
        # include_usage: the SDK asks a streamed chat completion for usage only when told
        model_settings=ModelSettings(temperature=0, max_tokens=48, include_usage=True),
    )
    return clerk, writer


def _server_id(response: ModelResponse) -> str | None:
    """The id the gateway gave a model call: the response's (Responses API), or the
    chat completion's, which the SDK keeps on each output item."""
    if response.response_id and response.response_id != FAKE_RESPONSES_ID:
        return response.response_id
    data = getattr(response.output[0], "provider_data", None) or {}
    return data.get("response_id")


async def _run(url: str, api: str) -> tuple[Ledger, RunResult, RunResultStreaming]:
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        if api == "chat":
            model: Any = OpenAIChatCompletionsModel("default", client)
        else:
            model = OpenAIResponsesModel("default", client)
        clerk, writer = _agents(model)
        chained = api == "responses-chained"
        ledger = Ledger()
        looked_up = await Runner.run(clerk, "Where is Ada's order?", context=ledger,
                                     max_turns=4, auto_previous_response_id=chained)  # fmt: skip
        ask: list[Any] = [{"role": "user", "content": "So where is it?"}]
        if chained:  # only what is new, the status tool's result first: the store has the rest
            ask.insert(0, looked_up.new_items[-1].to_input_item())
            answered = Runner.run_streamed(writer, ask, context=ledger,
                                           previous_response_id=looked_up.last_response_id)  # fmt: skip
        else:
            answered = Runner.run_streamed(writer, looked_up.to_input_list() + ask, context=ledger)
        async for _ in answered.stream_events():
            pass
    return ledger, looked_up, answered


@pytest.fixture(scope="module", autouse=True)
def _no_tracing_export():
    set_tracing_disabled(True)  # the SDK would export its traces to OpenAI's servers


@pytest.fixture
def loopback_peers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The hosts this process connects to during the test; any other than loopback is
    refused with an OSError (and the test fails on it)."""
    peers: list[str] = []
    connect = socket.socket.connect

    def loopback_only(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            peers.append(address[0])
            if not ipaddress.ip_address(address[0]).is_loopback:
                raise OSError(f"the test may only connect to loopback, not {address}")
        connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    return peers


@pytest.mark.parametrize("api", ["responses", "responses-chained", "chat"])
def test_an_agent_calls_both_tools_and_finishes(cluster: TestCluster, api: str, loopback_peers):
    before = metric_value(cluster.metrics(), "radixserve_requests_total")
    ledger, looked_up, answered = asyncio.run(_run(cluster.url, api))

    # both tools ran once, in order, with the arguments the model sent, which validate
    items = [item for r in looked_up.raw_responses for item in r.output]
    calls = [item for item in items if isinstance(item, ResponseFunctionToolCall)]
    assert calls == items  # each turn's output was its one call
    assert [c.name for c in calls] == [name for name, _ in ledger.calls] == list(TOOLS)
    for call, (name, arguments) in zip(calls, ledger.calls, strict=True):
        assert json.loads(call.arguments) == arguments
        jsonschema.validate(arguments, TOOLS[name].params_json_schema)
    assert looked_up.final_output == SHIPPED  # StopAtTools: the last tool's result
    assert isinstance(answered.final_output, Answer)  # parsed from the streamed reply

    # the gateway served exactly these model calls, in order, counting what the SDK saw
    responses = looked_up.raw_responses + answered.raw_responses
    assert len(responses) == 3
    cluster.wait_clean()  # a stream's request is logged as done once its body is sent
    records = cluster.http.get("/debug/explorer/requests", params={"limit": 3}).json()
    records = records["requests"][::-1]  # oldest first
    assert [r["request_id"] for r in records] == [_server_id(r) for r in responses]
    assert [r["status"] for r in records] == ["done"] * 3
    assert [r["prompt_tokens"] for r in records] == [r.usage.input_tokens for r in responses]
    assert [r["completion_tokens"] for r in records] == [r.usage.output_tokens for r in responses]
    if api != "chat":  # the stored responses show what the SDK asked for
        ids = [r["request_id"] for r in records]
        stored = [cluster.http.get(f"/v1/responses/{i}").json() for i in ids]
        assert [[t["name"] for t in s["tools"]] for s in stored] == [["find_order"],
                                                                  ["order_status"], []]  # fmt: skip
        assert [s["tool_choice"] for s in stored] == ["required", "required", "auto"]
        assert stored[2]["text"]["format"]["type"] == "json_schema"
        chained = [None, *ids[:2]] if api == "responses-chained" else [None] * 3
        assert [s["previous_response_id"] for s in stored] == chained
    after = metric_value(cluster.metrics(), "radixserve_requests_total")
    assert after - before == len(responses)
    assert loopback_peers  # the guard saw the SDK's connections
