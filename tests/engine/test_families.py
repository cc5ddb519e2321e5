"""Model families beyond Llama: each a tiny random-init model built from transformers'
config class here (no download), saved as safetensors and written as GGUF, whose greedy
tokens equal transformers' over 32 new tokens in float32 with quantization none, from
both files; cache on equals cache off, chunked prefill equals unchunked. A config
feature that is not implemented is refused at load, naming the field and its value.

- Qwen3: RMSNorm over each head of q and k before RoPE, no q/k/v bias, head_dim (32)
  independent of hidden / heads (16); its chat template's ``enable_thinking`` switch
  (``chat_template_kwargs``) renders as transformers renders it."""

from __future__ import annotations

import json

import pytest
import torch

from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import ModelLoadError
from radixserve.model.checkpoint import load_checkpoint
from tests.engine.engine_helpers import assert_greedy_matches_transformers, make_engine
from tests.model.tiny_checkpoints import build_tiny_model, write_tiny_checkpoint, write_tiny_gguf

FAMILIES = {"qwen3": {"arch": "qwen3", "tie": False, "head_dim": 32}}
NEW_TOKENS = 32


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 21, 40)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, safetensors directory, GGUF file, the transformers model)."""
    kwargs = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = write_tiny_checkpoint(root / "hf", **kwargs)
    gguf = write_tiny_gguf(root / "tiny.gguf", **kwargs)
    return request.param, hf_dir, gguf, build_tiny_model(**kwargs)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_greedy_tokens_equal_transformers(family, source):
    _, hf_dir, gguf, hf = family
    engine = make_engine(str(hf_dir if source == "safetensors" else gguf), page_size=4)
    assert engine.config.architecture == family[0]
    assert_greedy_matches_transformers(engine, hf, _prompts(engine.config.vocab_size), NEW_TOKENS)


def test_cache_on_equals_off_and_chunked_equals_unchunked(family):
    _, hf_dir, _, _ = family
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
    off = make_engine(str(hf_dir), page_size=4, prefix_cache=False)
    prompts = _prompts(off.config.vocab_size)
    want = [r.token_ids for r in off.generate(prompts, params)]
    cached = make_engine(str(hf_dir), page_size=4)
    assert [r.token_ids for r in cached.generate(prompts, params)] == want
    again = cached.generate(prompts, params)  # each prompt's prefix now from the cache
    assert [r.token_ids for r in again] == want
    assert all(r.cached_tokens >= len(p) - 4 for r, p in zip(again, prompts))
    chunked = make_engine(str(hf_dir), page_size=4, prefix_cache=False,
                          max_num_batched_tokens=16, prefill_chunk_tokens=16)  # fmt: skip
    assert [r.token_ids for r in chunked.generate(prompts, params)] == want


@pytest.mark.parametrize(
    ("arch", "field", "value"),
    [("qwen3", "use_sliding_window", True)],
)
def test_an_unsupported_config_field_is_refused_by_name(tmp_path, arch, field, value):
    root = write_tiny_checkpoint(tmp_path, **FAMILIES[arch])
    config = json.loads((root / "config.json").read_text())
    config[field] = value
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"{field}={value!r}"):
        load_checkpoint(str(root), progress=False)


# Qwen3's chat template's switch, as its template writes it: with enable_thinking false
# the generation prompt holds an empty think block
QWEN3_THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False}])
def test_qwen3_enable_thinking_renders_as_transformers(tmp_path, kwargs):
    from transformers import PreTrainedTokenizerFast

    root = write_tiny_checkpoint(tmp_path, **FAMILIES["qwen3"])
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_THINKING_TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_checkpoint(str(root), progress=False).tokenizer
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"))
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    want = theirs.apply_chat_template(messages, chat_template=QWEN3_THINKING_TEMPLATE,
                                      add_generation_prompt=True, tokenize=False, **kwargs)  # fmt: skip
    assert ours.apply_chat_template(messages, True, **kwargs) == want
    assert ("<think>" in want) == (kwargs.get("enable_thinking") is False)
