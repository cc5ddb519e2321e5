"""LoRA adapters of the tests' tiny model (`engine_helpers.tiny_checkpoint`), made with
``peft`` on the model written as a Hugging Face directory: "qv" (rank 8 on q_proj and
v_proj) and "all" (rank 16 on every projection), their A and B random so each changes
the answer; "wide" (rank 128) is over the default max_lora_rank (64)."""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "qv": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all": {"r": 16, "lora_alpha": 8, "target_modules": ALL},
    "wide": {"r": 128, "lora_alpha": 16, "target_modules": ["q_proj"]},
}


def write_adapters(model_dir: Path, root: Path, names: tuple[str, ...]) -> dict[str, Path]:
    """Save each adapter of ``names`` for the model at ``model_dir`` under ``root``."""
    import peft
    from transformers import AutoModelForCausalLM

    dirs = {}
    for seed, name in enumerate(names):
        base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        config = peft.LoraConfig(**ADAPTERS[name], lora_dropout=0.0)
        model = peft.get_peft_model(base, config)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if ".lora_A." in pname or ".lora_B." in pname:
                    param.copy_(0.3 * torch.randn(param.shape, generator=g))
        model.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def greedy_text(engine: Engine, prompt: list[int], adapter: str, max_tokens: int) -> str:
    """``engine``'s greedy text for ``prompt`` with ``adapter`` ("" = the base model), in
    a cache scope of its own (its pages never serve the requests a test sends later)."""
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    rid = engine.add_request(prompt, params, cache_scope="reference", adapter=adapter)
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                text += out.new_text
    return text
