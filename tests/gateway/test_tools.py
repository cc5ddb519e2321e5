"""Tool calling on /v1/chat/completions: tools rendered by a template's own `tools`
variable (equal to transformers') or the generic rendering, `required` and named
functions enforced by the grammar (arguments validate), streamed calls reassembled by
the OpenAI SDK, a tool loop, and bad tool fields refused by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from radixserve.model.chat_template import ChatTemplate
from radixserve.services.gateway.openai_api.schemas import ChatCompletionRequest
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.gateway.tools.tool_request import ToolFormat, template_inputs, tool_request
from tests.gateway.conftest import assert_openai_error

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                           "b": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    {"role": "system", "content": "You are terse."},
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]  # fmt: skip

# Qwen2.5-Instruct's chat template (its tool parts verbatim)
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501


def _prompt(template: str, body: dict) -> str:
    req = ChatCompletionRequest.model_validate(body)
    tools = tool_request(req, GatewaySettings().prepare_limits())
    messages, kwargs = template_inputs(req, tools, ToolFormat.for_template(template))
    return ChatTemplate(template).render(messages, True, **kwargs)


def test_a_template_with_tools_renders_them_as_transformers_does():
    fmt = ToolFormat.for_template(QWEN_TEMPLATE)
    assert fmt.native and fmt.parser == "hermes"
    hf_history = json.loads(json.dumps(HISTORY))  # arguments as an object, as Qwen expects
    call = hf_history[2]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])
    for messages, hf_messages in ((ASK, ASK), (HISTORY, hf_history)):
        ours = _prompt(QWEN_TEMPLATE, {"messages": messages, "tools": TOOLS})
        (theirs,), _ = render_jinja_template([hf_messages], tools=TOOLS,
                                             chat_template=QWEN_TEMPLATE,
                                             add_generation_prompt=True)  # fmt: skip
        assert ours == theirs
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in ours
    none = _prompt(QWEN_TEMPLATE, {"messages": ASK, "tools": TOOLS, "tool_choice": "none"})
    assert "<tools>" not in none  # tool_choice none: no tools in the prompt


def test_a_template_without_tools_gets_the_generic_rendering(client):
    template = client.tokenizer.chat_template
    fmt = ToolFormat.for_template(template)
    assert not fmt.native and fmt.parser == "hermes"
    prompt = _prompt(template, {"messages": HISTORY, "tools": TOOLS})
    assert prompt.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert json.dumps(WEATHER) in prompt and json.dumps(ADD) in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>') in prompt  # fmt: skip
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>' in prompt
    assert "<tools>" not in _prompt(template, {"messages": ASK})


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _check_calls(choice, allowed: set[str]) -> None:
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in allowed
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_choices_give_valid_arguments(oai):
    named = {"type": "function", "function": {"name": "add"}}
    for choice, allowed, seed in (("required", {"get_weather", "add"}, 0), (named, {"add"}, 1)):
        # n choices draw from the seed and their index: 3 samples per request
        r = oai.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                        tool_choice=choice, n=3, seed=seed,
                                        temperature=1.0, max_tokens=48)  # fmt: skip
        for c in r.choices:
            _check_calls(c, allowed)


def test_streamed_calls_reassemble_to_the_non_streamed_ones(oai):
    args = dict(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                temperature=0, max_tokens=48)  # fmt: skip
    full = oai.chat.completions.create(**args).choices[0]
    _check_calls(full, {"get_weather", "add"})
    with oai.chat.completions.stream(**args) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in full.message.tool_calls
    ]
    chunks = list(oai.chat.completions.create(**args, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    first = deltas[0][0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name
    fragments = [d[0].function.arguments for d in deltas[1:]]
    assert len(fragments) > 1 and not any(d[0].id for d in deltas[1:])  # as generated
    assert "".join(fragments) == full.message.tool_calls[0].function.arguments


def test_auto_choice_and_a_tool_loop_are_served(oai):
    r = oai.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                    temperature=0, max_tokens=8)  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.tool_calls or isinstance(c.message.content, str)
    loop = oai.chat.completions.create(model="default", messages=HISTORY, tools=TOOLS,
                                       temperature=0, max_tokens=8)  # fmt: skip
    assert loop.choices[0].finish_reason in ("stop", "length", "tool_calls")
    parallel_off = oai.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                               tool_choice="required", max_tokens=48,
                                               parallel_tool_calls=False, temperature=0)  # fmt: skip
    _check_calls(parallel_off.choices[0], {"get_weather", "add"})


BAD_TOOLS = {  # body fields -> the param the error names
    "tool type": ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    "no function": ({"tools": [{"type": "function"}]}, "tools[0].function"),
    "bad name": ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
                 "tools[0].function.name"),
    "parameters not an object": ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    "duplicate name": ({"tools": [ADD, ADD]}, "tools[1].function.name"),
    "unknown choice": ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    "required without tools": ({"tool_choice": "required"}, "tool_choice"),
    "named function not in tools": ({"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    "forced with response_format": ({"tools": TOOLS, "tool_choice": "required",
                                     "response_format": {"type": "json_object"}}, "tool_choice"),
    "unenforceable schema": ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"},
        "tools[0].function.parameters"),
    "strict with auto": ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}, "strict": True}}]},
        "tools[0].function.strict"),
    "tools through chat_template_kwargs": ({"chat_template_kwargs": {"tools": []}},
                                           "chat_template_kwargs"),
    "tool message without tool_call_id": ({"messages": [*ASK, {"role": "tool", "content": "x"}]},
                                          "messages[1].tool_call_id"),
    "user message without content": ({"messages": [{"role": "user"}]}, "messages[0].content"),
}  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), BAD_TOOLS.values(), ids=BAD_TOOLS.keys())
def test_bad_tool_fields_are_400_naming_the_field(http, fields, param):
    body = {"messages": ASK, "max_tokens": 2, **fields}
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param, error
    assert error["message"].startswith(param) or param in error["message"], error
    assert "List should" not in error["message"] and "Input should" not in error["message"]


def test_tokenize_renders_tools_as_chat_does(http):
    """/tokenize with messages and tools counts the prompt a chat request with those
    tools runs; tools with a bare prompt, or malformed, are a 400 naming the field."""
    plain = http.post("/tokenize", json={"messages": ASK}).json()
    tokenized = http.post("/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    assert tokenized["count"] > plain["count"]
    text = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert "<tool_call>" in text and '"get_weather"' in text  # this model: the generic block
    chat = http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS,
                                                   "max_tokens": 1}).json()  # fmt: skip
    assert chat["usage"]["prompt_tokens"] == tokenized["count"]
    error = assert_openai_error(http.post("/tokenize", json={"prompt": "Hi", "tools": TOOLS}),
                                400)  # fmt: skip
    assert error["param"] == "tools" and "messages" in error["message"]
    bad = http.post("/tokenize", json={"messages": ASK, "tools": [{"type": "web_search"}]})
    assert assert_openai_error(bad, 400)["param"] == "tools[0].type"
