"""Checkpoint loading: the default GGUF against transformers; tiny HF directories and GGUFs."""

from __future__ import annotations

import json
import shutil
import types

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from radixserve.model.checkpoint import (
    Checkpoint,
    expected_weights,
    load_checkpoint,
    resolve_model_path,
)
from radixserve.model.config import RopeScaling
from radixserve.model.gguf_loader import _unpermute_rows
from tests.model.tiny_checkpoints import (
    CHATML_TEMPLATE,
    build_tiny_model,
    llamacpp_permute,
    write_tiny_checkpoint,
    write_tiny_gguf,
)

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 64,
}
LLAMA31 = {**LLAMA3, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LINEAR = {"rope_type": "linear", "factor": 2.0}


@pytest.fixture(scope="module")
def transformers_state_dict(hf_smol):
    return hf_smol.state_dict()


@pytest.fixture(scope="module")
def default_weights(default_checkpoint):
    return dict(default_checkpoint.iter_weights(torch.float32))


# -- the default model -------------------------------------------------------------------


def test_default_config(default_checkpoint):
    c = default_checkpoint.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == (
        "llama",
        49152,
        576,
        1536,
    )
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.max_position_embeddings == 8192
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert c.name
    assert default_checkpoint.path == resolve_model_path("default")
    assert default_checkpoint.path.suffix == ".gguf"


def test_default_weight_names(default_checkpoint, default_weights, transformers_state_dict):
    assert list(default_weights) == [n for n, _ in expected_weights(default_checkpoint.config)]
    assert set(default_weights) == set(transformers_state_dict) - {"lm_head.weight"}


@pytest.mark.parametrize("layer", [0, 1, 14, 29])
def test_default_layer_weights_match_transformers(default_weights, transformers_state_dict, layer):
    names = [n for n in default_weights if n.startswith(f"model.layers.{layer}.")]
    assert len(names) == 9
    for name in names:
        ours, reference = default_weights[name], transformers_state_dict[name]
        assert ours.dtype == torch.float32 and ours.shape == reference.shape, name
        assert (ours - reference).abs().max().item() <= 1e-5, name


def test_default_global_weights_match_transformers(default_weights, transformers_state_dict):
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        ours, reference = default_weights[name], transformers_state_dict[name]
        assert ours.shape == reference.shape, name
        assert (ours - reference).abs().max().item() <= 1e-5, name


def test_qk_rows_are_unpermuted(default_weights, transformers_state_dict):
    """Without undoing llama.cpp's permutation Q and K would differ from transformers."""
    for name in (
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
    ):
        reference = transformers_state_dict[name]
        heads = 9 if "q_proj" in name else 3
        permuted = llamacpp_permute(reference.numpy(), heads)
        assert not np.allclose(permuted, reference.numpy(), atol=1e-3)
        assert (default_weights[name] - reference).abs().max().item() <= 1e-5


@pytest.mark.parametrize("shape", [(12, 5), (12,)])
def test_unpermute_invertsllamacpp_permute(shape):
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    assert np.array_equal(_unpermute_rows(llamacpp_permute(w, 3), 3), w)
    assert not np.array_equal(llamacpp_permute(w, 3), w)


def test_iter_weights_casts_dtype(default_checkpoint):
    name, tensor = next(default_checkpoint.iter_weights(torch.bfloat16))
    assert name == "model.embed_tokens.weight"
    assert tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu"
    assert tensor.shape == (49152, 576)


# -- laziness and progress ---------------------------------------------------------------


class _CountingSource:
    def __init__(self, inner):
        self.inner, self.path, self.reads = inner, inner.path, 0

    def names(self):
        return self.inner.names()

    def read(self, name):
        self.reads += 1
        return self.inner.read(name)


def test_iter_weights_is_lazy(tmp_path):
    loaded = load_checkpoint(write_tiny_checkpoint(tmp_path), progress=False)
    source = _CountingSource(loaded.source)
    ck = Checkpoint(loaded.config, loaded.tokenizer, loaded.path, source, progress=False)
    weights = ck.iter_weights(torch.float32)
    assert isinstance(weights, types.GeneratorType) and source.reads == 0
    next(weights)
    next(weights)
    assert source.reads == 2
    assert sum(1 for _ in weights) == len(expected_weights(ck.config)) - 2


@pytest.mark.parametrize("progress", [True, False])
def test_progress_bar_goes_to_stderr(tmp_path, capsys, progress):
    ck = load_checkpoint(write_tiny_checkpoint(tmp_path), progress=progress)
    list(ck.iter_weights(torch.float32))
    out, err = capsys.readouterr()
    assert out == ""
    n = len(expected_weights(ck.config))
    assert (f"{n}/{n}" in err) == progress


# -- Hugging Face directories ------------------------------------------------------------

VARIANTS = {
    "llama-tied": {"arch": "llama", "tie": True},
    "llama-untied-llama3": {"arch": "llama", "tie": False, "rope_scaling": LLAMA3},
    "qwen2-bias": {"arch": "qwen2", "tie": False},
    "mistral": {"arch": "mistral", "tie": True},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_directory_weights_equal_state_dict(tmp_path, variant):
    kwargs = VARIANTS[variant]
    path = write_tiny_checkpoint(tmp_path, **kwargs)
    ck = load_checkpoint(str(path), progress=False)
    c = ck.config
    assert c.architecture == kwargs["arch"]
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (512, 64, 128, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 16)
    assert c.tie_word_embeddings == kwargs["tie"]
    assert c.attention_bias == (kwargs["arch"] == "qwen2")
    assert c.rope_theta == 10000.0 and c.max_position_embeddings == 256
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert c.name == path.name

    state = load_file(str(path / "model.safetensors"))
    ours = dict(ck.iter_weights(torch.float32))
    assert set(ours) == set(state) - ({"lm_head.weight"} if kwargs["tie"] else set())
    if kwargs["arch"] == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in ours
    for name, tensor in ours.items():
        assert torch.equal(tensor, state[name]), name

    tok = ck.tokenizer
    assert tok.eos_token_ids == (2,) and tok.chat_template == CHATML_TEMPLATE
    assert tok.vocab_size == c.vocab_size
    assert tok.decode(tok.encode("some text")) == "some text"


def test_llama3_rope_scaling_is_parsed(tmp_path):
    ck = load_checkpoint(write_tiny_checkpoint(tmp_path, tie=False, rope_scaling=LLAMA3))
    assert ck.config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 2.0, 64)


def test_sharded_checkpoint_with_index(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny = write_tiny_checkpoint(tmp_path / "tiny", arch="qwen2", tie=False)
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(tiny)).save_pretrained(sharded, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, sharded / name)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    ours = dict(load_checkpoint(sharded, progress=False).iter_weights(torch.float32))
    reference = load_file(str(tiny / "model.safetensors"))
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name


def test_template_list_jinja_file_and_eos_lists(tmp_path):
    path = write_tiny_checkpoint(tmp_path)
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT"},
    ]
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ck = load_checkpoint(path, progress=False)
    assert ck.tokenizer.chat_template == "DEFAULT"
    assert ck.config.eos_token_ids == (2, 0) == ck.tokenizer.eos_token_ids
    (path / "chat_template.jinja").write_text("JINJA {{ messages[0].content }}")
    ck = load_checkpoint(path, progress=False)
    assert ck.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "JINJA x"


@pytest.mark.parametrize("tie", [True, False])
def test_missing_tie_flag_follows_lm_head_presence(tmp_path, tie):
    path = write_tiny_checkpoint(tmp_path, tie=tie)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["tie_word_embeddings"]
    (path / "config.json").write_text(json.dumps(cfg))
    ck = load_checkpoint(path, progress=False)
    assert ck.config.tie_word_embeddings == tie
    assert ("lm_head.weight" in dict(ck.iter_weights(torch.float32))) == (not tie)


GGUF_VARIANTS = {
    "llama-tied-f16": {"arch": "llama", "tie": True, "f16": True},
    "llama-llama3": {"arch": "llama", "tie": False, "rope_scaling": LLAMA31},
    "qwen2-linear": {"arch": "qwen2", "tie": False, "rope_scaling": LINEAR},
    "qwen3": {"arch": "qwen3", "tie": False, "head_dim": 32},
}


@pytest.mark.parametrize("variant", sorted(GGUF_VARIANTS))
def test_tiny_gguf_round_trips(tmp_path, variant):
    """Q/K un-permuted for llama (only), biases, F16, rope scaling from metadata."""
    kwargs = GGUF_VARIANTS[variant]
    path = write_tiny_gguf(tmp_path / "tiny.gguf", **kwargs)
    ck = load_checkpoint(path, progress=False)
    c = ck.config
    assert (c.architecture, c.name, c.vocab_size, c.num_layers) == (
        kwargs["arch"],
        f"tiny-{kwargs['arch']}",
        512,
        2,
    )
    head_dim = kwargs.get("head_dim", 16)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (4, 2, head_dim, 128)
    assert c.tie_word_embeddings == kwargs["tie"]
    assert c.attention_bias == (kwargs["arch"] == "qwen2")
    assert c.qk_norm == (kwargs["arch"] == "qwen3")
    assert (
        c.rope_scaling
        == {
            None: None,
            "llama3": RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
            "linear": RopeScaling("linear", 2.0),
        }[(kwargs.get("rope_scaling") or {}).get("rope_type")]
    )
    assert ck.tokenizer.decode(ck.tokenizer.encode("some text")) == "some text"
    assert ck.tokenizer.eos_token_ids == (2,) == c.eos_token_ids
    assert ck.tokenizer.vocab_size == 512 and ck.tokenizer.decode([511]) == "<extra_511>"

    model_kwargs = {k: v for k, v in kwargs.items() if k != "f16"}
    reference = build_tiny_model(**model_kwargs).state_dict()
    ours = dict(ck.iter_weights(torch.float32))
    assert set(ours) == set(reference) - ({"lm_head.weight"} if kwargs["tie"] else set())
    atol = 1e-3 if kwargs.get("f16") else 0.0
    for name, tensor in ours.items():
        assert (tensor - reference[name]).abs().max().item() <= atol, name
