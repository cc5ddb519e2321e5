"""Qwen3: Llama with an RMSNorm over each head of q and k before RoPE. A GGUF
``qwen3moe`` file without experts is one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixserve.model.families.family import Family
from radixserve.model.families.qwen2 import qwen_windows


class Qwen3(Family):
    name = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM",)
    gguf_archs = ("qwen3", "qwen3moe")
    qk_norm = True

    def hf_fields(self, cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
        return qwen_windows(cfg, layers)


FAMILY = Qwen3()
