"""Qwen2: Llama with q/k/v biases; a sliding window only where the config turns it on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixserve.model.families.family import Family, PreTokenizer
from radixserve.model.families.llama import LLAMA3_SPLIT

# Llama 3's split but digits one by one, after NFC (Qwen2's tokenizer.json)
_QWEN2 = PreTokenizer(split=LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"), nfc=True)


def qwen_windows(cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """Qwen2's and Qwen3's sliding window as transformers applies it: only with
    `use_sliding_window`, on the layers `layer_types` names (transformers 5) or else from
    `max_window_layers` on; {} for global attention."""
    window = cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window"):
        return {}
    first = int(cfg.get("max_window_layers", layers))
    kinds = cfg.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(layers)
    ]
    return {
        "sliding_window": int(window),
        "sliding_layers": tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention"),
    }


class Qwen2(Family):
    name = "qwen2"
    hf_architectures = ("Qwen2ForCausalLM",)
    gguf_archs = ("qwen2",)
    attention_bias = True
    pre_tokenizers = dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2)

    def hf_fields(self, cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
        return qwen_windows(cfg, layers)


FAMILY = Qwen2()
