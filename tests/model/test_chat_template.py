"""Chat templates render like transformers' `apply_chat_template`; bad input is a 400."""

from __future__ import annotations

import pytest

from radixserve.errors import InvalidRequestError, ModelLoadError
from radixserve.model.chat_template import ChatTemplate, validate_messages
from radixserve.model.tokenizer import Tokenizer
from tests.model.tiny_checkpoints import build_tiny_tokenizer

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CONVERSATIONS = {
    "user-only": [{"role": "user", "content": "Hello"}],
    "with-system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi-turn": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 🐍 and\nnewlines."},
    ],
    "system-multi-turn": [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
}


def test_default_model_renders_smollm2_prompt(default_checkpoint):
    prompt = default_checkpoint.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}]
    )
    assert prompt == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(default_checkpoint, hf_gguf_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = default_checkpoint.tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt
    )
    theirs = hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_system_message_replaces_default(default_checkpoint):
    prompt = default_checkpoint.tokenizer.apply_chat_template(CONVERSATIONS["with-system"])
    assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert SMOL_SYSTEM not in prompt


def test_helpers_and_variables():
    source = (
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}"
        "{% if loop.index == 1 %}{% continue %}{% endif %}!{% endfor %}"
        "{{ extra }}|{{ strftime_now('%Y') | length }}{{ eos_token }}"
    )
    out = ChatTemplate(source).render(
        [{"role": "user", "content": "<é>"}, {"role": "assistant", "content": "x"}],
        bos_token="<s>",
        eos_token="</s>",
        extra="EXTRA",
    )
    # tojson does not escape HTML and keeps non-ASCII; loopcontrols works.
    assert out == (
        '<s>{"role": "user", "content": "<é>"}{"role": "assistant", "content": "x"}!EXTRA|4</s>'
    )


def test_trim_and_lstrip_blocks():
    source = "  {% for m in messages %}\n{{ m.content }}\n  {% endfor %}\n"
    assert ChatTemplate(source).render([{"role": "user", "content": "a"}]) == "a\n"


def test_text_parts_are_joined_and_none_keys_dropped():
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
            "name": None,
        }
    ]
    checked = validate_messages(messages)
    assert checked == [{"role": "user", "content": "one\ntwo"}]
    assert isinstance(messages[0]["content"], list)  # the caller's message is untouched
    source = "{{ messages[0].content }}{{ messages[0].name is defined }}"
    assert ChatTemplate(source).render(messages) == "one\ntwoFalse"


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        None,
        [],
        ["hello"],
        [{"content": "no role"}],
        [{"role": 3, "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "http://x"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 1}]}],
    ],
)
def test_bad_messages_are_invalid_requests(messages):
    with pytest.raises(InvalidRequestError):
        ChatTemplate("{{ messages }}").render(messages)


def test_raise_exception_is_invalid_request():
    source = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('first message must be system') }}{% endif %}ok"
    )
    template = ChatTemplate(source)
    assert template.render([{"role": "system", "content": "s"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="first message must be system"):
        template.render([{"role": "user", "content": "u"}])


def test_runtime_template_errors_are_invalid_requests():
    with pytest.raises(InvalidRequestError):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_attribute_escapes():
    with pytest.raises(InvalidRequestError):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render(
            [{"role": "user", "content": "x"}]
        )


def test_syntax_error_is_a_load_error():
    with pytest.raises(ModelLoadError, match="chat template"):
        ChatTemplate("{% for m in messages %}")


def test_no_template_is_an_invalid_request():
    tok = Tokenizer(build_tiny_tokenizer(), eos_token_ids=[2])
    assert tok.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
