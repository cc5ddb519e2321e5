"""Random LoRA adapters in PEFT's layout, for the LoRA benchmark (`bench/lora.py`).

`write_adapter` writes what PEFT's ``save_pretrained`` writes for a Llama-family model:
``adapter_config.json`` and ``adapter_model.safetensors`` with one A (r, in) and one B
(out, r) per adapted projection, named ``base_model.model.model.layers.<i>.<module>.
lora_<A|B>.weight``. The shapes come from the model's config (hidden size, heads, KV
heads, head dim, MLP width, layers), not from the engine's own mapping, so a mistake in
either shows as a refused adapter.

The numbers are seeded Gaussians, sized so an adapter moves the answers without
breaking them: A ~ N(0, 1/in), so A @ x has the scale of x's entries, and B ~ N(0,
(strength / (scaling sqrt(r)))^2), so the update scaling * B @ A @ x has about
``strength`` times the scale of x's entries (the base projections' outputs are of the
order of x's). A trained adapter starts from B = 0 and ends somewhere near this.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from radixserve.model.config import ModelConfig

#: the seven projections of a Llama layer, as PEFT names them, and their module path
MODULES = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
#: the update's scale against its input's (module notes): the default model's greedy
#: answers depart from the base model's within two dozen tokens and stay English
DEFAULT_STRENGTH = 0.1


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection's (out, in) features, from the model's config."""
    hidden, q = config.hidden_size, config.num_heads * config.head_dim
    kv, mlp = config.num_kv_heads * config.head_dim, config.intermediate_size
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (mlp, hidden),
        "up_proj": (mlp, hidden),
        "down_proj": (hidden, mlp),
    }


def write_adapter(
    path: Path,
    config: ModelConfig,
    rank: int,
    seed: int,
    strength: float = DEFAULT_STRENGTH,
    targets: tuple[str, ...] = tuple(MODULES),
) -> Path:
    """A seeded random rank-``rank`` adapter on ``targets`` of every layer, written to
    the directory ``path`` (made if missing); returns ``path``."""
    alpha = 2 * rank  # scaling 2, PEFT's common choice
    scaling = alpha / rank
    gen = torch.Generator().manual_seed(seed)
    b_std = strength / (scaling * math.sqrt(rank))
    tensors = {}
    shapes = projection_shapes(config)
    for layer in range(config.num_layers):
        for target in targets:
            out_features, in_features = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{MODULES[target]}"
            a = torch.randn(rank, in_features, generator=gen) / math.sqrt(in_features)  # (r, in)
            b = torch.randn(out_features, rank, generator=gen) * b_std  # (out, r)
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": config.name,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return path
