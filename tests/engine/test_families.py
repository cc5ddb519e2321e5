"""Model families beyond Llama: each a tiny random-init model built from transformers'
config class here (no download), saved as safetensors and written as GGUF, whose greedy
tokens equal transformers' over 32 new tokens in float32 with quantization none, from
both files; cache on equals cache off, chunked prefill equals unchunked. A config
feature that is not implemented is refused at load, naming the field and its value.

- Qwen3: RMSNorm over each head of q and k before RoPE, no q/k/v bias, head_dim (32)
  independent of hidden / heads (16); its chat template's ``enable_thinking`` switch
  (``chat_template_kwargs``) renders as transformers renders it.
- Qwen3-MoE: Qwen3's attention, experts in layers 0 and 2 and a dense MLP in layer 1
  (``mlp_only_layers``), top-2 of 8 renormalised; GGUF ``qwen3moe`` with stacked experts.
- Mixtral: experts in every layer (top-2 of 4); GGUF ``llama`` with expert tensors (Q/K
  permuted as llama.cpp writes them). Its experts quantized (int8, int4) stay close to
  the float model.

- Gemma 3: a window of 8 (the prompts are 5, 21 and 40 tokens, then 32 more) on five of
  six layers, RoPE bases 1e6 (scaled linearly) and 1e4, (1 + w) norms before and after
  the attention and the MLP, GELU-tanh, embeddings times sqrt(hidden), a logit soft cap;
  its softmax scale from query_pre_attn_scalar (safetensors: the GGUF has no field for
  it); a cached prefix longer than the window gives the recomputed answer. Its chat
  template renders as transformers renders it, and refuses what it refuses.

The routers are random normal (`tiny_checkpoints._randomize`), so tokens spread over
the experts and a mis-routed token changes the answer."""

from __future__ import annotations

import json
import re

import pytest
import torch

from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import InvalidRequestError, ModelLoadError
from radixserve.model.checkpoint import load_checkpoint
from radixserve.model.qlinear import Int4Linear, Int8Linear
from tests.engine.engine_helpers import (
    FLOAT32,
    assert_greedy_matches_transformers,
    chunked_logits,
    make_engine,
)
from tests.model.tiny_checkpoints import build_tiny_model, write_tiny_checkpoint, write_tiny_gguf

FAMILIES = {
    "qwen3": {"arch": "qwen3", "tie": False, "head_dim": 32},
    # sparse, dense (mlp_only_layers), sparse: 8 experts of 32 rows, top 2, renormalised
    "qwen3_moe": {"arch": "qwen3_moe", "tie": False, "head_dim": 32, "num_hidden_layers": 3,
                  "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "mlp_only_layers": [1], "norm_topk_prob": True},
    # every layer sparse: 4 experts of 64 rows, top 2
    "mixtral": {"arch": "mixtral", "tie": False, "num_local_experts": 4,
                "num_experts_per_tok": 2, "intermediate_size": 64},
    # layers 0-4 see a window of 8 (shorter than the prompts), layer 5 everything; the
    # global layers' RoPE base 1e6 scaled linearly by 8, the local ones' 1e4; a soft cap
    "gemma3": {"arch": "gemma3", "tie": True, "num_hidden_layers": 6, "sliding_window": 8,
               "head_dim": 16,
               "query_pre_attn_scalar": 16, "final_logit_softcapping": 30.0,
               "rope_parameters": {
                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
}  # fmt: skip
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


def test_speculative_verification_gives_the_same_tokens(family):
    """With the draft index holding each prompt's answer (decoded without speculation)
    with its 11th token changed, every family's engine verifies long drafts of it, its
    sliding windows, experts and soft caps included, rejects the changed token, and
    answers the same tokens."""
    _, hf_dir, _, _ = family
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
    off = make_engine(str(hf_dir), page_size=4)
    prompts = _prompts(off.config.vocab_size)
    want = [r.token_ids for r in off.generate(prompts, params)]
    on = make_engine(str(hf_dir), page_size=4, speculative_method="radix")
    # how far it drafts: fixed (a row a tenth of a one-row step)
    on.speculator.cost.seconds = lambda most: [9.0 + r for r in range(1, most + 1)]
    for prompt, answer in zip(prompts, want):
        wrong = [*answer[:10], (answer[10] + 1) % off.config.vocab_size, *answer[11:]]
        on.speculator.index.add(None, [*prompt, *wrong])
    assert [r.token_ids for r in on.generate(prompts, params)] == want
    stats = on.speculator.stats["radix"]
    assert stats.accepted >= NEW_TOKENS, stats  # long drafts verified and kept ...
    assert stats.drafted > stats.accepted, stats  # ... and the changed tokens rejected
    on.check_integrity()


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_greedy_tokens_equal_transformers(family, source):
    _, hf_dir, gguf, hf = family
    engine = make_engine(str(hf_dir if source == "safetensors" else gguf), page_size=4,
                         **FLOAT32)  # fmt: skip
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
    assert max(r.cached_tokens for r in again) > 8  # Gemma's window: a prefix past it
    chunked = make_engine(str(hf_dir), page_size=4, prefix_cache=False,
                          max_num_batched_tokens=16, prefill_chunk_tokens=16)  # fmt: skip
    assert [r.token_ids for r in chunked.generate(prompts, params)] == want


@pytest.mark.parametrize(
    ("arch", "field", "value", "named"),
    [
        # Qwen3's long-context recipe: YaRN, not implemented
        ("qwen3", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'"),
        ("qwen3_moe", "shared_expert_intermediate_size", 64, None),
        ("mixtral", "hidden_act", "gelu", None),
        ("gemma3", "attn_logit_softcapping", 50.0, None),
    ],
)
def test_an_unsupported_config_field_is_refused_by_name(tmp_path, arch, field, value, named):
    root = write_tiny_checkpoint(tmp_path, **FAMILIES[arch])
    config = json.loads((root / "config.json").read_text())
    if field == "rope_scaling":  # the transformers 4 field, in place of the 5 one
        config.pop("rope_parameters", None)
    config[field] = value
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=re.escape(named or f"{field}={value!r}")):
        load_checkpoint(str(root), progress=False)


@pytest.mark.parametrize(
    ("arch", "window"),
    [
        ("mistral", {"sliding_window": 8}),  # every layer
        # the layers from max_window_layers on
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                   "head_dim": 32}),
    ],
)  # fmt: skip
def test_sliding_windows_of_the_other_families(tmp_path, arch, window):
    """Mistral's window and Qwen's use_sliding_window, shorter than the prompts, as
    transformers applies them (safetensors: llama.cpp's GGUFs of these carry none)."""
    kwargs = {"arch": arch, "tie": False, **window}
    engine = make_engine(str(write_tiny_checkpoint(tmp_path, **kwargs)), page_size=4, **FLOAT32)
    assert engine.config.sliding_window == 8 and engine.config.sliding_layers
    assert_greedy_matches_transformers(
        engine, build_tiny_model(**kwargs), _prompts(engine.config.vocab_size), NEW_TOKENS
    )


def test_gemma3_softmax_scale_from_query_pre_attn_scalar(tmp_path):
    """Gemma 3 27B's scalar is not its head_dim: the scale follows the config."""
    kwargs = {**FAMILIES["gemma3"], "query_pre_attn_scalar": 40}
    engine = make_engine(str(write_tiny_checkpoint(tmp_path, **kwargs)), page_size=4, **FLOAT32)
    assert engine.config.attention_scale == 40**-0.5
    assert_greedy_matches_transformers(
        engine, build_tiny_model(**kwargs), _prompts(engine.config.vocab_size)[1:], NEW_TOKENS
    )


@pytest.mark.parametrize(
    ("stored", "scheme", "layer", "similarity"),
    [
        ("float32", "int8", Int8Linear, 0.999),
        ("float32", "int4", Int4Linear, 0.98),
        ("Q4_0", "auto", Int4Linear, 0.97),  # a GGUF's Q4_0 expert blocks read as int4
    ],
)
def test_quantized_experts_stay_close_to_float(tmp_path, stored, scheme, layer, similarity):
    """Experts quantized at load (int8, int4) or read quantized from a GGUF run as the
    scheme's layers, expert by expert, and stay close to the float model."""
    root = write_tiny_checkpoint(tmp_path / "hf", **FAMILIES["mixtral"])
    ids = _prompts(512)[2]
    want = chunked_logits(make_engine(str(root), **FLOAT32), ids)
    if stored != "float32":
        root = write_tiny_gguf(tmp_path / "tiny.gguf", quant=stored, **FAMILIES["mixtral"])
    engine = make_engine(str(root), dtype="float32", quantization=scheme)
    moe = engine.model.decoder_layers[0].moe
    assert moe is not None and moe.quantized
    assert all(isinstance(e, layer) for e in (*moe.gate_up, *moe.down))
    got = chunked_logits(engine, ids)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > similarity
    assert not torch.equal(got, want)  # the quantized experts did run


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


# Gemma 3's chat template as the family ships it: a system message folded into the first
# user turn, "model" for the assistant, roles that must alternate
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def test_gemma3_chat_template_renders_as_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    root = write_tiny_checkpoint(tmp_path, **FAMILIES["gemma3"])
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = GEMMA3_TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_checkpoint(str(root), progress=False).tokenizer
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"),
                                     bos_token="<|im_start|>")  # fmt: skip
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "  Why is the sky blue? "},
        {"role": "assistant", "content": "Rayleigh scattering."},
        {"role": "user", "content": "And sunsets?"},
    ]
    want = theirs.apply_chat_template(messages, chat_template=GEMMA3_TEMPLATE,
                                      add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert ours.apply_chat_template(messages, True) == want
    assert want.count("<start_of_turn>model") == 2
    with pytest.raises(InvalidRequestError, match="roles must alternate"):  # a 400
        ours.apply_chat_template(messages[:2] + messages[1:2], True)


def test_configs_as_transformers_4_writes_them():
    """The published configs' layout (transformers 4): Qwen3-MoE's `num_experts` and
    `decoder_sparse_step`, Gemma 3's `rope_theta` / `rope_local_base_freq` /
    `rope_scaling` and `sliding_window_pattern`."""
    from radixserve.model.hf_config import parse_config

    common = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 256}  # fmt: skip
    moe = parse_config({**common, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                        "decoder_sparse_step": 2, "mlp_only_layers": [5],
                        "norm_topk_prob": True}, "m", [])  # fmt: skip
    assert (moe.num_experts, moe.moe_layers, moe.norm_topk_prob) == (8, (1, 3), True)
    gemma = parse_config({**common, "architectures": ["Gemma3ForCausalLM"],
                          "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 512,
                          "sliding_window_pattern": 3, "rope_theta": 1e6,
                          "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 16,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "g", [])  # fmt: skip
    assert gemma.sliding_layers == (0, 1, 3, 4) and gemma.sliding_window == 512
    assert (gemma.rope_theta, gemma.rope_local_theta) == (1e6, 1e4)
    assert gemma.rope_scaling is not None and gemma.rope_scaling.factor == 8.0
    assert gemma.tie_word_embeddings and gemma.embed_scale and gemma.post_norms
