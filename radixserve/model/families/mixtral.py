"""Mixtral: Mistral with experts in every layer (``intermediate_size`` is an expert's),
under ``block_sparse_moe`` with w1 (gate), w3 (up), w2 (down). Its GGUF files are
llama's with expert tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixserve.model.families.family import Family, TensorNames
from radixserve.model.families.mistral import every_layer_window


class Mixtral(Family):
    name = "mixtral"
    hf_architectures = ("MixtralForCausalLM",)
    gguf_archs = ("llama",)
    experts = True
    gguf_permuted_qk = True
    names = TensorNames(moe_block="block_sparse_moe", experts=("w1", "w3", "w2"))

    def hf_fields(self, cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
        return {
            "num_experts": int(cfg["num_local_experts"]),
            "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True,
            "moe_layers": tuple(range(layers)),
            **every_layer_window(cfg, layers),
        }


FAMILY = Mixtral()
