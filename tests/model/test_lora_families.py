"""PEFT LoRA adapters on the families `tests/model/test_lora.py` does not cover: Mistral
(its sliding window, 8, shorter than the longer prompt), Qwen3-MoE (experts in layers 0
and 2, a dense MLP in layer 1) and Mixtral (experts in every layer).

Adapters made with ``peft`` here, their A and B random: "qv" (rank 8 on q_proj and
v_proj) and "attn" (rank 16 on q, k, v and o, rsLoRA); Mistral also gets "all" (the
seven projections). The engine runs in float32 and its greedy tokens equal transformers
+ peft's, an adapter alone and every adapter in one batch beside the base model, and
from the GGUF files of the mixture-of-experts families too. An
adapter on a mixture-of-experts layer's experts (or its router) is refused at load,
naming what it targets.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from radixserve.engine.engine import Engine
from radixserve.errors import ModelLoadError
from radixserve.settings import EngineSettings
from tests.engine.engine_helpers import FLOAT32, assert_no_leaks
from tests.model.test_lora import peft_reference, run_jobs, tiny_family
from tests.model.tiny_checkpoints import write_tiny_gguf

peft = pytest.importorskip("peft")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
FAMILIES = {
    # a window of 8 on every layer: the 21-token prompt runs past it
    "mistral": {"arch": "mistral", "tie": False, "sliding_window": 8},
    # sparse, dense (mlp_only_layers), sparse: 4 experts of 32 rows, top 2
    "qwen3_moe": {"arch": "qwen3_moe", "tie": False, "head_dim": 32, "num_hidden_layers": 3,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "mlp_only_layers": [1], "norm_topk_prob": True},
    # every layer sparse: 4 experts of 64 rows, top 2
    "mixtral": {"arch": "mixtral", "tie": False, "num_local_experts": 4,
                "num_experts_per_tok": 2, "intermediate_size": 64},
}  # fmt: skip
ADAPTERS = {
    "qv": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "attn": {"r": 16, "lora_alpha": 8, "target_modules": ATTENTION, "use_rslora": True},
    "all": {"r": 8, "lora_alpha": 8, "target_modules": ALL},
}
# adapters on the expert MLPs are refused: attention only where there are experts
FAMILY_ADAPTERS = {"mistral": ("qv", "attn", "all"), "qwen3_moe": ("qv", "attn"),
                   "mixtral": ("qv", "attn")}  # fmt: skip
NEW_TOKENS = 10
SMALL = {"page_size": 4, "kv_cache_memory_gib": 0.01, "device": "cpu", "load_progress": False}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 512, (length,), generator=g).tolist() for length in (21, 6)]


def _run(engine: Engine, jobs: list[tuple[list[int], str]]) -> list[list[int]]:
    """Greedy tokens of (prompt, adapter) jobs, run as one batch."""
    return run_jobs(engine, jobs, NEW_TOKENS)[0]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """`tiny_family` of each family here, with its adapters."""
    adapters = {name: ADAPTERS[name] for name in FAMILY_ADAPTERS[request.param]}
    return tiny_family(request.param, FAMILIES[request.param], adapters,
                       tmp_path_factory.mktemp(request.param))  # fmt: skip


def _engine(model_dir: Path, dirs: dict[str, Path]) -> Engine:
    modules = tuple(f"{name}={path}" for name, path in dirs.items())
    return Engine(EngineSettings(model=str(model_dir), lora_modules=modules,
                                 **{**SMALL, **FLOAT32}))  # fmt: skip


def test_adapter_tokens_equal_peft_alone_and_mixed(family):
    """Each family's greedy tokens with an adapter equal transformers + peft's: the widest
    adapter alone, then both prompts under the base model and every adapter in one batch
    (rows interleaved: each must get its own adapter); every adapter changes them."""
    name, model_dir, dirs, models = family
    engine = _engine(model_dir, dirs)
    assert engine.config.architecture == name
    prompts = _prompts()
    want = {
        (i, a): peft_reference(m, p, NEW_TOKENS)
        for i, p in enumerate(prompts)
        for a, m in models.items()
    }
    widest = FAMILY_ADAPTERS[name][-1]
    assert _run(engine, [(prompts[0], widest)]) == [want[0, widest]]
    jobs = [(i, a) for i in range(len(prompts)) for a in models]
    assert _run(engine, [(prompts[i], a) for i, a in jobs]) == [want[job] for job in jobs]
    for i, a in jobs:  # the adapters do change the answer
        assert a == "" or want[i, a] != want[i, ""], (i, a)
    assert_no_leaks(engine)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"], indirect=True)
def test_adapters_on_the_gguf_file_equal_peft(family, tmp_path):
    """The same model read from GGUF (Mixtral's as llama's, its Q and K rows permuted as
    llama.cpp writes them and put back at load): the attention adapter's q and k updates
    land on the rows they were trained for."""
    name, _, dirs, models = family
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", **FAMILIES[name])
    engine = _engine(gguf, {"attn": dirs["attn"]})
    prompts = _prompts()
    want = [peft_reference(models["attn"], p, NEW_TOKENS) for p in prompts]
    assert _run(engine, [(p, "attn") for p in prompts]) == want
    assert_no_leaks(engine)


def _with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def _hand_written(path: Path, module: str, a_shape: tuple, b_shape: tuple) -> Path:
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                          "lora_alpha": 8}))  # fmt: skip
    key = f"base_model.model.{module}"
    save_file({f"{key}.lora_A.weight": torch.zeros(a_shape),
               f"{key}.lora_B.weight": torch.zeros(b_shape)},
              str(path / "adapter_model.safetensors"))  # fmt: skip
    return path


# (family, what is changed, what the refusal names): expert targets as the published
# checkpoints name them (Mixtral's block_sparse_moe.experts.N.w1, Qwen3-MoE's
# mlp.experts.N.gate_proj), the router, and peft's parameter targets (transformers 5's
# fused expert stacks)
EXPERT_CASES = [
    ("mixtral", {"target_modules": ["q_proj", "w1", "w3"]}, "['w1', 'w3']"),
    ("mixtral", {"tensor": "model.layers.0.block_sparse_moe.experts.1.w1"}, "targets an expert"),
    ("qwen3_moe", {"tensor": "model.layers.2.mlp.experts.3.down_proj"}, "targets an expert"),
    ("qwen3_moe", {"target_modules": ["q_proj", "gate"]}, "['gate']"),
    ("qwen3_moe", {"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
]


@pytest.mark.parametrize(
    ("family", "change", "named"),
    EXPERT_CASES,
    indirect=["family"],
    ids=["w1-w3", "expert-w1", "expert-down", "router", "parameters"],
)
def test_adapters_on_experts_are_refused_by_name(family, tmp_path, change, named):
    _, model_dir, dirs, _ = family
    engine = _engine(model_dir, {})
    if "tensor" in change:
        module = change["tensor"]
        path = _hand_written(tmp_path / "adapter", module, (4, 64), (64, 4))
    else:
        path = _with_config(dirs["qv"], tmp_path / "adapter", **change)
    with pytest.raises(ModelLoadError, match=re.escape(named)) as info:
        engine.load_lora("experts", str(path))
    assert "tensor" not in change or change["tensor"] in str(info.value)
    assert "experts" not in engine.loras.adapters
    engine.load_lora("qv", str(dirs["qv"]))  # the attention adapter beside it loads
