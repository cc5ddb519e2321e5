"""The model-family registry (`radixserve.model.families`): each family found by its
config.json architecture and its GGUF arch, and a family defined outside the package
plugging in as one `Family`: a renamed Llama (a new architecture name, its own norm
names in the checkpoint) loads from a tiny random-init checkpoint and its greedy tokens
equal transformers' Llama on the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.errors import ModelLoadError
from radixserve.model.families.family import TensorNames
from radixserve.model.families.llama import Llama
from radixserve.model.families.registry import by_name, for_gguf, for_hf, register, unregister
from radixserve.model.hf_config import read_hf_dir
from tests.engine.engine_helpers import FLOAT32, assert_greedy_matches_transformers, make_engine
from tests.model.tiny_checkpoints import build_tiny_model, write_tiny_checkpoint

RENAMED_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}


class LlamaVariant(Llama):
    """Llama under another architecture name, its layer norms renamed."""

    name = "llama_variant"
    hf_architectures = ("LlamaVariantForCausalLM",)
    gguf_archs = ()
    names = TensorNames(norms={"input_norm": "attn_norm", "post_norm": "mlp_norm"})


@pytest.fixture
def variant():
    family = LlamaVariant()
    register(family)
    yield family
    unregister(family.name)


@pytest.fixture
def variant_dir(tmp_path):
    """A tiny Llama checkpoint rewritten as the variant: its architecture name and its
    norms' names."""
    root = write_tiny_checkpoint(tmp_path, arch="llama", tie=False)
    config = json.loads((root / "config.json").read_text())
    config["architectures"] = ["LlamaVariantForCausalLM"]
    (root / "config.json").write_text(json.dumps(config))
    path = root / "model.safetensors"
    tensors = load_file(str(path))
    for old, new in RENAMED_NORMS.items():
        tensors = {name.replace(f".{old}.", f".{new}."): t for name, t in tensors.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return root


def test_each_family_is_found_by_its_names():
    assert for_hf(["Foo", "MixtralForCausalLM"]).name == "mixtral"
    assert for_hf(["Gemma3ForCausalLM"]).norm_offset
    # one GGUF arch, two families: experts tell them apart
    assert for_gguf("llama", experts=True).name == "mixtral"
    assert for_gguf("llama", experts=False).name == "llama"
    assert for_gguf("qwen3moe", experts=False).name == "qwen3"
    assert for_gguf("qwen3moe", experts=True).name == "qwen3_moe"
    assert by_name("qwen2").attention_bias
    with pytest.raises(ModelLoadError, match="'FooForCausalLM'.*Qwen2ForCausalLM"):
        for_hf(["FooForCausalLM"])
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'falcon'"):
        for_gguf("falcon", experts=False)


def test_a_family_name_is_taken_once(variant):
    with pytest.raises(ValueError, match="LlamaVariantForCausalLM"):
        register(LlamaVariant())
    with pytest.raises(ValueError, match="llama"):
        register(Llama())


def test_an_unregistered_architecture_is_refused(variant_dir):
    with pytest.raises(ModelLoadError, match="LlamaVariantForCausalLM"):
        read_hf_dir(variant_dir)


def test_a_registered_family_loads_and_equals_transformers(variant, variant_dir):
    engine = make_engine(str(variant_dir), page_size=4, **FLOAT32)
    assert engine.config.architecture == "llama_variant"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 19)]
    hf = build_tiny_model("llama", tie=False)  # the same weights, under Llama's names
    assert_greedy_matches_transformers(engine, hf, prompts, 16)
