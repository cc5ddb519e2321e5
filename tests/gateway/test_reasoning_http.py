"""Reasoning through real HTTP: a tiny Qwen3 checkpoint served by the in-process gateway
with Qwen3's own chat template (and a DeepSeek-R1-style one whose generation prompt
opens ``<think>``), its reasoning returned as ``reasoning_content`` (chat) and as
``reasoning`` items (the Responses API, through the openai SDK), streamed and not.

A random model never writes ``</think>``, so the checkpoint's weights are made to
write a known reply: every layer's output projections (attention ``o_proj``, MLP
``down_proj``) are zero, so the last hidden state is the current token's embedding,
and the chain's tokens get orthogonal embeddings and an untied ``lm_head`` whose row
for the next token of the chain reads that embedding. Greedy decoding then follows
``\\n → <think> → Hello → " world" → </think> → The → " answer" → <|im_end|>``: after
Qwen3's generation prompt (ending in ``\\n``) the reply is
``<think>Hello world</think>The answer``; after the R1-style one (ending in
``<think>``) it is ``Hello world</think>The answer``. Everything else (the engine, the
template rendering, the parsing, the HTTP) is the real path.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from tokenizers import AddedToken

from radixserve.engine.async_engine import AsyncEngine
from radixserve.services.gateway import LocalEngineClient
from tests.engine.engine_helpers import make_engine
from tests.gateway.conftest import RunningServer, assert_openai_error, gateways
from tests.model.tiny_checkpoints import (
    EOS_ID,
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
)

# Qwen3's chat template as the Qwen3 checkpoints ship it (tokenizer_config.json)
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# the DeepSeek-R1 convention on ChatML: the generation prompt opens the think block,
# earlier turns' reasoning is dropped (no thinking switch)
R1_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}"
    "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>' }}{% endif %}"
)

THINK, END_THINK = "<think>", "</think>"
REASONING, ANSWER = "Hello world", "The answer"
CHAIN = ["\n", THINK, "Hello", " world", END_THINK, "The", " answer"]  # then <|im_end|>


def write_thinking_checkpoint(root: Path, template: str, loop: bool = False) -> Path:
    """A tiny Qwen3 checkpoint that greedily writes the chain (module docstring); with
    `loop`, one that reasons ``Hello world Hello world ...`` until something writes its
    ``</think>`` (a thinking budget), then answers as the other (2,048 positions)."""
    tok = build_tiny_tokenizer(510)  # + <think>, </think> (plain added tokens, as Qwen3's)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in (THINK, END_THINK)])
    ids = []
    for piece in CHAIN:
        encoded = tok.encode(piece).ids
        assert len(encoded) == 1, (piece, encoded)  # one token each, all distinct
        ids.append(encoded[0])
    assert len(set(ids)) == len(ids)
    model = build_tiny_model("qwen3", tie=False, head_dim=32,
                             max_position_embeddings=2048 if loop else 256)  # fmt: skip
    following_ids = [*ids[1:], EOS_ID]
    if loop:  # " world" -> "Hello"
        following_ids[CHAIN.index(" world")] = ids[CHAIN.index("Hello")]
    hidden = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        scale = hidden**0.5  # RMS 1: the final norm leaves it as it is
        for i, (current, following) in enumerate(zip(ids, following_ids)):
            model.model.embed_tokens.weight[current].zero_()
            model.model.embed_tokens.weight[current, i] = scale
            model.lm_head.weight[following, i] = 8.0  # logit 8 x 8 = 64; every other 0
    root.mkdir(parents=True)
    model.save_pretrained(root)
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[1],
              "eos_token": SPECIAL_TOKENS[EOS_ID], "add_bos_token": False,
              "chat_template": template}  # fmt: skip
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("thinking")
    return {"qwen3": write_thinking_checkpoint(base / "qwen3", QWEN3_TEMPLATE),
            "r1": write_thinking_checkpoint(base / "r1", R1_TEMPLATE),
            "loop": write_thinking_checkpoint(base / "loop", QWEN3_TEMPLATE, loop=True)}  # fmt: skip


@pytest.fixture(scope="module")
def engines(checkpoints) -> Iterator[dict[str, LocalEngineClient]]:
    clients = {name: LocalEngineClient(AsyncEngine(make_engine(str(root),
                                                               kv_cache_memory_gib=0.02)))
               for name, root in checkpoints.items()}  # fmt: skip
    yield clients
    for client in clients.values():
        client.close()


@pytest.fixture
def serve(engines) -> Iterator:
    """Start a gateway (GatewaySettings fields) on one of the engines (by name, qwen3 by
    default): (server, client)."""
    with gateways(lambda name="qwen3": engines[name]) as start:
        yield start


def _chat(http: httpx.Client, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _chat_stream(http: httpx.Client, **fields) -> tuple[dict, list[dict]]:
    """The message the streamed deltas add up to, and the deltas."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "stream": True,
            **fields}  # fmt: skip
    deltas, finish = [], None
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                deltas.append(choice["delta"])
                finish = choice["finish_reason"] or finish
    message = {"role": "assistant",
               "content": "".join(d.get("content") or "" for d in deltas),
               "reasoning_content": "".join(d.get("reasoning_content") or "" for d in deltas)
               or None}  # fmt: skip
    return {"message": message, "finish_reason": finish}, deltas


@pytest.mark.parametrize("name", ["qwen3", "r1"])
def test_reasoning_is_separated_streamed_and_not(serve, name):
    _, http = serve(name)
    whole = _chat(http)["choices"][0]
    assert whole["message"] == {"role": "assistant", "content": ANSWER,
                                "reasoning_content": REASONING}  # fmt: skip
    assert whole["finish_reason"] == "stop"
    streamed, deltas = _chat_stream(http)
    assert streamed == {"message": whole["message"], "finish_reason": "stop"}
    reasoning_at = [i for i, d in enumerate(deltas) if d.get("reasoning_content")]
    content_at = [i for i, d in enumerate(deltas) if d.get("content")]
    assert reasoning_at and content_at and max(reasoning_at) < min(content_at)
    for delta in deltas:  # no marker, no reasoning text is ever sent as content
        assert not any(word in (delta.get("content") or "") for word in ("<", "Hello", "world"))


@pytest.mark.parametrize(("name", "max_tokens"), [("qwen3", 3), ("r1", 2)])
def test_a_reply_cut_inside_its_reasoning_is_all_reasoning(serve, name, max_tokens):
    _, http = serve(name)
    whole = _chat(http, max_tokens=max_tokens)["choices"][0]
    assert whole["message"] == {"role": "assistant", "content": "",
                                "reasoning_content": REASONING}  # fmt: skip
    assert whole["finish_reason"] == "length"
    streamed, _ = _chat_stream(http, max_tokens=max_tokens)
    assert streamed == {"message": whole["message"], "finish_reason": "length"}


def test_the_setting_overrides_the_template(serve):
    _, http = serve(reasoning_parser="none")
    message = _chat(http)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": f"{THINK}{REASONING}{END_THINK}{ANSWER}"}
    _, http = serve("qwen3", reasoning_parser="deepseek_r1")  # same split on this reply
    assert _chat(http)["choices"][0]["message"]["reasoning_content"] == REASONING


def _tokenize(http: httpx.Client, messages: list[dict], **fields) -> list[int]:
    response = http.post("/tokenize", json={"messages": messages, **fields})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def _template_ids(root: Path, messages: list[dict], **kwargs) -> list[int]:
    """The prompt transformers renders with the checkpoint's own template."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(root))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                   **kwargs)  # fmt: skip
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["qwen3", "r1"])
def test_the_next_turn_renders_as_the_template_says(serve, checkpoints, name):
    """The reply sent back (with its reasoning_content) renders as transformers renders
    it: Qwen3 drops an earlier turn's thinking after a new user message but keeps it in
    a tool-calling turn; the R1-style template drops it (it renders no tools: the
    gateway's generic tool rendering would differ from transformers', so no tool turn)."""
    _, http = serve(name)
    reply = _chat(http)["choices"][0]["message"]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    conversations = {
        "next question": [{"role": "user", "content": "Hi"}, reply,
                          {"role": "user", "content": "And then?"}],
        "tool result": [{"role": "user", "content": "Hi"}, {**reply, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    }  # fmt: skip
    if name == "r1":
        del conversations["tool result"]
    for label, messages in conversations.items():
        ids = _tokenize(http, messages)
        template_messages = [
            {**m, "tool_calls": [{**call, "function": {"name": "get",
                                                      "arguments": {"city": "Paris"}}}]}
            if m.get("tool_calls") else m for m in messages
        ]  # fmt: skip
        assert ids == _template_ids(checkpoints[name], template_messages), label
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        kept = f"{THINK}\n{REASONING}\n{END_THINK}" in text
        assert kept == (name == "qwen3" and label == "tool result"), (label, text)


def test_the_next_turn_reads_the_first_from_the_cache(serve, engines):
    """A next turn, rendered with the reply and its reasoning as the template says, is
    served from the cache up to where it leaves the first turn's prompt (in whole
    pages): the template's rendering keeps the cache's prefix."""
    _, http = serve("qwen3")
    page = engines["qwen3"].cache_page_size
    first = [{"role": "user", "content": "Tell me about rivers. " * 6}]
    reply = _chat(http, messages=first)["choices"][0]["message"]
    first_ids = _tokenize(http, first)
    assert len(first_ids) > 2 * page
    for label, messages in {
        "next question": [*first, reply, {"role": "user", "content": "And then?"}],
        "tool result": [*first, {**reply, "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    }.items():  # fmt: skip
        ids = _tokenize(http, messages)
        common = next((i for i, (a, b) in enumerate(zip(first_ids, ids)) if a != b),
                      min(len(first_ids), len(ids)))  # fmt: skip
        usage = _chat(http, messages=messages, max_tokens=1)["usage"]
        assert usage["prompt_tokens"] == len(ids), label
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert common // page * page <= cached < len(ids), (label, common, cached)


def test_the_thinking_switch(serve, checkpoints):
    """chat_template_kwargs and reasoning_effort reach Qwen3's enable_thinking; a request
    setting it both ways, or reasoning_content on a user message, is refused by name."""
    _, http = serve("qwen3")
    messages = [{"role": "user", "content": "Hi"}]
    off = _tokenize(http, messages, chat_template_kwargs={"enable_thinking": False})
    assert off == _template_ids(checkpoints["qwen3"], messages, enable_thinking=False)
    on = _chat(http)["usage"]["prompt_tokens"]
    assert len(off) == on + 6  # <think>\n\n</think>\n\n
    for fields in ({"chat_template_kwargs": {"enable_thinking": False}},
                   {"reasoning_effort": "none"}):  # fmt: skip
        assert _chat(http, **fields)["usage"]["prompt_tokens"] == len(off)
    assert _chat(http, reasoning_effort="high")["usage"]["prompt_tokens"] == on
    both = http.post("/v1/chat/completions", json={
        "messages": messages, "reasoning_effort": "low",
        "chat_template_kwargs": {"enable_thinking": True}})  # fmt: skip
    assert assert_openai_error(both, 400)["param"] == "reasoning_effort"
    misplaced = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi", "reasoning_content": "x"}]})  # fmt: skip
    assert assert_openai_error(misplaced, 400)["param"] == "messages[0].reasoning_content"
    _, r1 = serve("r1")  # no switch in its template: only the default effort
    assert _chat(r1, reasoning_effort="medium")["choices"][0]["message"]["content"] == ANSWER
    refused = r1.post("/v1/chat/completions", json={"messages": messages,
                                                     "reasoning_effort": "none"})  # fmt: skip
    assert assert_openai_error(refused, 400)["param"] == "reasoning_effort"


def _sdk(running: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)


def _reasoning_and_text(response) -> tuple[str, str]:
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"], kinds
    reasoning = response.output[0]
    assert reasoning.summary == [] and reasoning.content is not None
    return reasoning.content[0].text, response.output_text


def test_responses_reasoning_items_through_the_sdk(serve):
    running, http = serve("qwen3")
    with _sdk(running) as client:
        whole = client.responses.create(model="default", input="Hi", temperature=0,
                                        reasoning={"effort": "high"})  # fmt: skip
        assert _reasoning_and_text(whole) == (REASONING, ANSWER)
        assert whole.reasoning is not None and whole.reasoning.effort == "high"
        with client.responses.stream(model="default", input="Hi", temperature=0,
                                     reasoning={"effort": "low"}) as stream:  # fmt: skip
            events = list(stream)
            final = stream.get_final_response()
    deltas = [e for e in events if isinstance(e, openai.types.responses.
                                              ResponseReasoningTextDeltaEvent)]  # fmt: skip
    done = [e for e in events if isinstance(e, openai.types.responses.
                                            ResponseReasoningTextDoneEvent)]  # fmt: skip
    assert "".join(e.delta for e in deltas) == REASONING
    assert [e.text for e in done] == [REASONING]
    assert all(e.output_index == 0 and e.item_id == final.output[0].id for e in deltas)
    assert _reasoning_and_text(final) == (REASONING, ANSWER)
    text_deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text_deltas == ANSWER
    stored = http.get(f"/v1/responses/{final.id}").json()
    assert stored["output"] == final.model_dump(mode="json", exclude_none=True)["output"]


def test_responses_effort_switch_and_refusals(serve):
    running, _ = serve("qwen3")
    with _sdk(running) as client:
        high = client.responses.create(model="default", input="Hi", reasoning={"effort": "high"})
        off = client.responses.create(model="default", input="Hi", reasoning={"effort": "none"})
        assert high.usage is not None and off.usage is not None
        assert off.usage.input_tokens == high.usage.input_tokens + 6  # the empty think block
        with pytest.raises(openai.BadRequestError) as summary:
            client.responses.create(model="default", input="Hi",
                                    reasoning={"effort": "low", "summary": "auto"})  # fmt: skip
        assert summary.value.body["param"] == "reasoning.summary"
    r1, _ = serve("r1")
    with _sdk(r1) as client:
        with pytest.raises(openai.BadRequestError) as effort:
            client.responses.create(model="default", input="Hi", reasoning={"effort": "high"})
        assert effort.value.body["param"] == "reasoning.effort"
        fine = client.responses.create(model="default", input="Hi",
                                       reasoning={"effort": "medium"})  # fmt: skip
        assert _reasoning_and_text(fine) == (REASONING, ANSWER)


def test_responses_next_turn_renders_as_the_chat_template(serve):
    """A continued response (previous_response_id) and one given its earlier reasoning
    and message as input items run the prompt the chat path renders for the same
    conversation (Qwen3's template dropping the earlier thinking)."""
    running, http = serve("qwen3")
    with _sdk(running) as client:
        first = client.responses.create(model="default", input="Hi", temperature=0)
        followed = client.responses.create(model="default", input="And then?",
                                           previous_response_id=first.id)  # fmt: skip
        items = [{"role": "user", "content": "Hi"},
                 *[item.model_dump(mode="json", exclude_none=True) for item in first.output],
                 {"role": "user", "content": "And then?"}]  # fmt: skip
        resent = client.responses.create(model="default", input=items)  # type: ignore[arg-type]
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
                {"role": "user", "content": "And then?"}]  # fmt: skip
    want = len(_tokenize(http, messages))
    assert followed.usage is not None and resent.usage is not None
    assert followed.usage.input_tokens == want == resent.usage.input_tokens
    assert _reasoning_and_text(resent) == (REASONING, ANSWER)
    bad = http.post("/v1/responses", json={"input": [
        {"type": "reasoning", "summary": [], "encrypted_content": "opaque"}]})  # fmt: skip
    assert assert_openai_error(bad, 400)["param"].startswith("input[0].encrypted_content")


@pytest.mark.parametrize(
    ("name", "budget", "reasoning"),
    [("qwen3", 1, "Hello"), ("r1", 1, "Hello"), ("qwen3", 0, None),
     ("r1", 2, REASONING),  # the reasoning is two tokens: a budget of two changes nothing
     ("loop", 5, "Hello worldHello worldHello")],
)  # fmt: skip
def test_a_thinking_token_budget_ends_the_reasoning(serve, name, budget, reasoning):
    """Qwen3's reply opens its reasoning with <think>, the R1-style one's prompt opens it:
    after `budget` reasoning tokens the engine writes </think> and the model answers."""
    _, http = serve(name)
    whole = _chat(http, thinking_token_budget=budget, max_tokens=64)["choices"][0]
    assert whole["message"] == {"role": "assistant", "content": ANSWER,
                                "reasoning_content": reasoning}  # fmt: skip
    assert whole["finish_reason"] == "stop"
    streamed, _ = _chat_stream(http, thinking_token_budget=budget, max_tokens=64)
    assert streamed == {"message": whole["message"], "finish_reason": "stop"}


def test_without_a_budget_the_loop_reasons_to_max_tokens(serve):
    _, http = serve("loop")
    whole = _chat(http, max_tokens=16)["choices"][0]
    assert whole["message"]["content"] == "" and whole["finish_reason"] == "length"


def test_thinking_token_budget_refusals(serve):
    _, http = serve("qwen3")
    for fields in ({"thinking_token_budget": -1},
                   {"thinking_token_budget": 4, "response_format": {"type": "json_object"}}):  # fmt: skip
        refused = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], **fields})  # fmt: skip
        assert assert_openai_error(refused, 400)["param"] == "thinking_token_budget", fields
    _, plain = serve(reasoning_parser="none")  # replies without reasoning: nothing to cap
    refused = plain.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "thinking_token_budget": 4})  # fmt: skip
    assert assert_openai_error(refused, 400)["param"] == "thinking_token_budget"
