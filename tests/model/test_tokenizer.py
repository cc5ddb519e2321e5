"""The GGUF tokenizer encodes like transformers' GGUF tokenizer and round-trips text."""

from __future__ import annotations

import json

import pytest
import tokenizers
from tokenizers import pre_tokenizers

from radixserve.errors import ModelLoadError
from radixserve.model.tokenizer import Tokenizer
from tests.model.tiny_checkpoints import build_tiny_tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "12345 3.14 -42 1e-5 0x1F 2025-01-01",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'print(f"{x!r:>10}")  # comment\n\tindented\r\n',
    "naïve café, Ünïcödé, 日本語のテキスト, русский, عربى",
    "emoji 🤗👍🏽 🇫🇷 and ZWJ 👩‍💻",
    "  leading spaces",
    "trailing spaces   ",
    "\n\nnewlines\n\n\nbetween\n",
    "I'm sure they'll say we've done what's right, don't you?",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>more<file_sep>",
    "",
    " ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_like_transformers_gguf_tokenizer(default_checkpoint, hf_gguf_tokenizer, text):
    ours = default_checkpoint.tokenizer.encode(text)
    assert ours == hf_gguf_tokenizer.encode(text)
    assert default_checkpoint.tokenizer.encode(text, add_special_tokens=False) == ours  # no BOS


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(default_checkpoint, hf_gguf_tokenizer, text):
    tok = default_checkpoint.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_special_tokens_are_single_ids(default_checkpoint):
    tok = default_checkpoint.tokenizer
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ids == [1, tok.token_to_id("user"), tok.token_to_id("Ċ"), tok.token_to_id("hi"), 2]
    assert tok.decode(ids) == "user\nhi"  # special tokens skipped


def test_digits_are_split_one_by_one(default_checkpoint):
    tok = default_checkpoint.tokenizer
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]


def test_smollm_pre_tokenizer_splits_digits_before_the_byte_level_regex(
    default_checkpoint, hf_gguf_tokenizer
):
    """A known divergence: transformers' GGUF tokenizer uses the plain GPT-2 regex for
    "smollm", so a run of spaces before a digit splits differently. We follow SmolLM's
    own tokenizer.json (Digits then ByteLevel), i.e. transformers' vocabulary and merges
    with that pre-tokenizer."""
    reference = tokenizers.Tokenizer.from_str(hf_gguf_tokenizer.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok = default_checkpoint.tokenizer
    for text in ["x  1", "  42", "a\t\t7 b", *TEXTS]:
        assert tok.encode(text) == reference.encode(text).ids, text
    assert tok.encode("x  1") == [tok.token_to_id(t) for t in ("x", "ĠĠ", "1")]


def test_default_tokenizer_properties(default_checkpoint):
    tok = default_checkpoint.tokenizer
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


def _gguf_meta(**overrides):
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": ["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġab", "<think>"],
        "tokenizer.ggml.token_type": [3, 3, 1, 1, 1, 1, 1, 4],
        "tokenizer.ggml.merges": ["a b", "Ġ ab"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    meta.update(overrides)
    return meta


def test_gguf_metadata_tokenizer_bos_and_user_defined_tokens():
    tok = Tokenizer.from_gguf_metadata(_gguf_meta(**{"tokenizer.ggml.add_bos_token": True}))
    assert tok.encode("ab ab") == [0, 4, 6]
    assert tok.encode("ab ab", add_special_tokens=False) == [4, 6]
    assert tok.encode("<think>ab") == [0, 7, 4]
    assert tok.decode([0, 7, 4, 1]) == "<think>ab"  # user-defined tokens are not special
    assert tok.eos_token_ids == (1,) and tok.bos_token_id == 0
    assert tok.vocab_size == 8


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "default"])
def test_other_byte_level_pre_tokenizers_build(pre):
    tok = Tokenizer.from_gguf_metadata(_gguf_meta(**{"tokenizer.ggml.pre": pre}))
    assert tok.decode(tok.encode("ab ab")) == "ab ab"


@pytest.mark.parametrize(
    "override",
    [
        {"tokenizer.ggml.pre": "some-new-thing"},
        {"tokenizer.ggml.model": "llama"},
        {"tokenizer.ggml.model": None},
        {"tokenizer.ggml.merges": ["a b c"]},
        {"tokenizer.ggml.tokens": []},
    ],
)
def test_unsupported_gguf_tokenizers_are_load_errors(override):
    with pytest.raises(ModelLoadError):
        Tokenizer.from_gguf_metadata(_gguf_meta(**override))


def test_from_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    build_tiny_tokenizer().save(str(path))
    tok = Tokenizer.from_file(
        path, bos_token="<|im_start|>", eos_tokens=["<|im_end|>", "<|nope|>"], eos_token_ids=[0]
    )
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (0, 2)
    assert tok.decode(tok.encode("some text")) == "some text"
    assert tok.encode("x", add_special_tokens=True) == tok.encode("x", add_special_tokens=False)
    with_bos = Tokenizer.from_file(path, bos_token="<|im_start|>", add_bos_token=True)
    assert with_bos.encode("x") == [1, *tok.encode("x")]


def test_from_file_errors_name_the_path(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(ModelLoadError, match=str(bad)):
        Tokenizer.from_file(bad)
