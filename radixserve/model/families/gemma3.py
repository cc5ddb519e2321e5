"""Gemma 3: a sliding window on five of six layers (their RoPE of another base), norms
after the attention and after the MLP as well as before them, a GELU (tanh) gated MLP,
embeddings scaled by sqrt(hidden), a softmax scale of its own and a soft cap on the
logits. Its norms multiply by (1 + w): read as 1 + w (`Family.norm_offset`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixserve.errors import ModelLoadError
from radixserve.model.families.family import Family, GGUFShape, TensorNames, refuse

_SHAPE = {"hidden_act": "gelu_tanh", "post_norms": True, "embed_scale": True}


class Gemma3(Family):
    name = "gemma3"
    hf_architectures = ("Gemma3ForCausalLM",)
    gguf_archs = ("gemma3",)
    activations = ("gelu_pytorch_tanh", "gelu_tanh")
    tie_by_default = True
    qk_norm = True
    norm_offset = True
    # post_attention_layernorm is the attention output's; the MLP's input norm is
    # pre_feedforward_layernorm (llama.cpp's ffn_norm)
    names = TensorNames(
        norms={
            "input_norm": "input_layernorm",
            "attn_out_norm": "post_attention_layernorm",
            "post_norm": "pre_feedforward_layernorm",
            "mlp_out_norm": "post_feedforward_layernorm",
        },
        gguf_blocks={
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
    )

    def refuse_unsupported(self, cfg: Mapping[str, Any]) -> None:
        if cfg.get("attn_logit_softcapping") is not None:
            refuse(cfg, "attn_logit_softcapping", "a soft cap on attention logits")

    def rope_config(self, cfg: Mapping[str, Any]) -> Mapping[str, Any]:
        """transformers 5's configs give one `rope_parameters` per layer type; without
        any, the global base is Gemma 3's 1e6."""
        params = cfg.get("rope_parameters") or {}
        if "full_attention" in params:
            return {"rope_parameters": params["full_attention"]}
        if not params and "rope_theta" not in cfg:
            return {**cfg, "rope_theta": 1_000_000.0}
        return cfg

    def hf_fields(self, cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
        """The sliding layers (`layer_types`, or the older `sliding_window_pattern`:
        every n-th layer global), the local layers' RoPE base (transformers 5's
        `rope_parameters.sliding_attention`, 4's `rope_local_base_freq`)."""
        kinds = cfg.get("layer_types")
        if kinds is None:
            n = int(cfg.get("sliding_window_pattern") or 6)
            kinds = ["sliding_attention" if (i + 1) % n else "full_attention"
                     for i in range(layers)]  # fmt: skip
        unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ModelLoadError(f"layer_types={unknown!r} is not supported (sliding_attention "
                                 "and full_attention layers only)")  # fmt: skip
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError("rope_parameters.sliding_attention.rope_type="
                                 f"{local['rope_type']!r} is not supported "
                                 "(the local layers' RoPE is unscaled)")  # fmt: skip
        return {
            **_SHAPE,
            "sliding_window": int(cfg["sliding_window"]),
            "sliding_layers": tuple(
                i for i, kind in enumerate(kinds) if kind == "sliding_attention"
            ),
            "rope_local_theta": float(
                local.get("rope_theta") or cfg.get("rope_local_base_freq") or 1e4
            ),
            "attention_scale": float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
            "final_logit_softcap": cfg.get("final_logit_softcapping"),
        }

    def gguf_fields(self, meta: Mapping[str, Any], shape: GGUFShape) -> dict[str, Any]:
        """As llama.cpp reads them: the window from the file; the pattern from
        ``attention.sliding_window_pattern`` (a period n: every n-th layer global, or a
        flag per layer) or else llama.cpp's 6; the local RoPE base from
        ``rope.freq_base_swa`` or else 10000; the softmax scale 1/sqrt(head_dim) except
        for the 62-layer 27B, whose query_pre_attn_scalar is hidden / heads (llama.cpp's
        rule: the file does not store it). The converter stores norms as 1 + w already."""

        def key(name: str) -> str:  # the file's arch prefixes its keys
            return f"{shape.arch}.{name}"

        if meta.get(key("attn_logit_softcapping")) is not None:
            raise ModelLoadError(f"{key('attn_logit_softcapping')}="
                                 f"{meta[key('attn_logit_softcapping')]!r} is not supported")  # fmt: skip
        pattern = meta.get(key("attention.sliding_window_pattern"), 6)
        if isinstance(pattern, list):
            sliding = tuple(i for i, flag in enumerate(pattern) if flag)
        else:
            n = int(pattern)
            sliding = tuple(i for i in range(shape.layers) if i % n < n - 1)
        scalar = shape.hidden / shape.heads if shape.layers == 62 else shape.head_dim
        return {
            **_SHAPE,
            "sliding_window": int(meta[key("attention.sliding_window")]),
            "sliding_layers": sliding,
            "rope_local_theta": float(meta.get(key("rope.freq_base_swa")) or 10000.0),
            "attention_scale": scalar**-0.5,
            "final_logit_softcap": meta.get(key("final_logit_softcapping")),
        }


FAMILY = Gemma3()
