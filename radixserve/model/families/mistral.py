"""Mistral: Llama with a sliding window on every layer (its GGUF files are llama's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixserve.model.families.family import Family


def every_layer_window(cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """``sliding_window`` on every layer, as transformers applies Mistral's and Mixtral's
    ({} without one)."""
    window = cfg.get("sliding_window")
    if not window:
        return {}
    return {"sliding_window": int(window), "sliding_layers": tuple(range(layers))}


class Mistral(Family):
    name = "mistral"
    hf_architectures = ("MistralForCausalLM",)
    gguf_permuted_qk = True

    def hf_fields(self, cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
        return every_layer_window(cfg, layers)


FAMILY = Mistral()
