"""Validation failures of the real request models become one sentence naming the field
as the request spells it, saying what was wrong and what is accepted (no server)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from radixserve.services.gateway.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from radixserve.services.gateway.responses_api.request import ResponsesRequest
from radixserve.services.gateway.server.field_errors import describe

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
CASES = [  # model, body, the sentence
    (CompletionRequest, {"prompt": 123}, "prompt must be a string or a list, got 123"),
    (CompletionRequest, {"prompt": [1, -1]}, "prompt[1] must be at least 0, got -1"),
    (CompletionRequest, {"prompt": [[]]}, "prompt[0] must have at least 1 item, got 0"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 2.5},
     "max_tokens must be an integer, got 2.5"),
    (ChatCompletionRequest, {**CHAT, "stop": 5}, "stop must be a string or a list, got 5"),
    (ChatCompletionRequest, {**CHAT, "stop": ["a"] * 17}, "stop must have at most 16 items, got 17"),
    (ChatCompletionRequest, {**CHAT, "temperature": "hot"},
     'temperature must be a number, got "hot"'),
    (ChatCompletionRequest, {**CHAT, "logit_bias": {"7": 200}},
     'logit_bias["7"] must be at most 100, got 200'),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     'messages[0].content[0].type must be "text", got "image"'),
    (ChatCompletionRequest, {"messages": [{"content": "x"}]},
     "messages[0].role is required but missing"),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "xml"}},
     'response_format.type must be "text", "json_object" or "json_schema", got "xml"'),
    (ChatCompletionRequest, {**CHAT, "audio": {}},
     "audio is not a field of this endpoint, or one radixserve does not implement: remove it"),
    (ResponsesRequest, {"input": "x", "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation must be false, got true"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "body", "sentence"), CASES)
def test_a_validation_error_is_one_sentence_naming_the_field(
    model: type[BaseModel], body: dict, sentence: str
):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    message, param = describe(info.value.errors())
    assert message == sentence
    assert param is not None and message.startswith(param)


def test_a_prefix_names_where_the_value_sits():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": "hi"})
    assert describe(info.value.errors(), "body[2]") == (
        'body[2].messages must be a list, got "hi"',
        "body[2].messages",
    )
