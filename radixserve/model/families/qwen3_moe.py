"""Qwen3-MoE: Qwen3's attention; experts in every ``decoder_sparse_step``-th layer but
those of ``mlp_only_layers``, under ``mlp`` with gate_proj, up_proj, down_proj. Its
expert count is ``num_experts`` (transformers 4, the published configs) or
``num_local_experts`` (as transformers 5 writes it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixserve.model.families.family import Family, refuse
from radixserve.model.families.qwen2 import qwen_windows


class Qwen3Moe(Family):
    name = "qwen3_moe"
    hf_architectures = ("Qwen3MoeForCausalLM",)
    gguf_archs = ("qwen3moe",)
    experts = True
    qk_norm = True

    def refuse_unsupported(self, cfg: Mapping[str, Any]) -> None:
        if cfg.get("shared_expert_intermediate_size"):
            refuse(cfg, "shared_expert_intermediate_size", "shared experts")

    def hf_fields(self, cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        sparse = (i for i in range(layers) if i not in dense and experts and (i + 1) % step == 0)
        return {
            "num_experts": experts,
            "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "moe_layers": tuple(sparse),
            **qwen_windows(cfg, layers),
        }


FAMILY = Qwen3Moe()
