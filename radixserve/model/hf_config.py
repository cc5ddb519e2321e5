"""A Hugging Face model directory's config.json and tokenizer files (no weights, no torch:
the gateway reads these alone).

Supported architectures: `ARCHITECTURES`. RoPE parameters are read from either the
transformers 4 layout (`rope_theta` and `rope_scaling`) or the transformers 5 one
(`rope_parameters`); Qwen3-MoE's expert count from `num_experts` (transformers 4, the
published configs) or `num_local_experts` (as transformers 5 writes it). A field whose
value changes the forward pass in a way not implemented is refused, naming the field and
value (`_refuse_unsupported`), never served wrong.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from radixserve.errors import ModelLoadError
from radixserve.model.config import ModelConfig, RopeScaling
from radixserve.model.tokenizer import Tokenizer

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma3ForCausalLM": "gemma3",
}
# the MLP activation each family's configs name (Gemma: gelu's tanh approximation)
_ACTIVATIONS = {"gemma3": ("gelu_pytorch_tanh", "gelu_tanh")}


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path} is missing")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    """A token id field that may be an int, a list of ints or null."""
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def _rope(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either config layout."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", factor=float(scaling["factor"]))
    if kind == "llama3":  # parameters not given keep RopeScaling's defaults
        optional = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        given = {k: type(getattr(RopeScaling, k))(scaling[k]) for k in optional if k in scaling}
        return theta, RopeScaling("llama3", factor=float(scaling["factor"]), **given)
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    raise ModelLoadError(f"{key}.rope_type={kind!r} is not supported (RoPE scaling: "
                         "default, linear or llama3)")  # fmt: skip


def _refuse_unsupported(cfg: Mapping[str, Any], arch: str) -> None:
    """ModelLoadError naming the first field whose value this decoder does not implement."""

    def refuse(key: str, what: str) -> None:
        raise ModelLoadError(f"{key}={cfg[key]!r} is not supported ({what})")

    acts = _ACTIVATIONS.get(arch, ("silu",))
    for act in ("hidden_activation", "hidden_act"):
        if act in cfg and cfg[act] is not None and cfg[act] not in acts:
            refuse(act, f"the MLP's activation must be {' or '.join(acts)}")
    if cfg.get("mlp_bias"):
        refuse("mlp_bias", "MLP biases")
    if arch == "qwen3_moe" and cfg.get("shared_expert_intermediate_size"):
        refuse("shared_expert_intermediate_size", "shared experts")
    if arch == "gemma3" and cfg.get("attn_logit_softcapping") is not None:
        refuse("attn_logit_softcapping", "a soft cap on attention logits")
    if cfg.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention", "bidirectional attention")
    for key, known in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        if cfg.get(key, known) != known:  # routing modes of other MoE families
            refuse(key, f"the router's top-k is over a {known!r} of its logits")


def _moe(cfg: Mapping[str, Any], arch: str, layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields ({} for a dense model)."""
    if arch == "mixtral":  # every layer; intermediate_size is an expert's
        experts = int(cfg["num_local_experts"])
        return {"num_experts": experts, "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
                "moe_intermediate_size": int(cfg["intermediate_size"]),
                "norm_topk_prob": True, "moe_layers": tuple(range(layers))}  # fmt: skip
    if arch != "qwen3_moe":
        return {}
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    sparse = tuple(i for i in range(layers) if i not in dense and experts and (i + 1) % step == 0)
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "moe_layers": sparse,
    }


def _gemma3(cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """Gemma 3's fields: the sliding layers (`layer_types`, or the older
    `sliding_window_pattern`: every n-th layer global), the local layers' RoPE base
    (transformers 5's `rope_parameters.sliding_attention`, 4's `rope_local_base_freq`)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        n = int(cfg.get("sliding_window_pattern") or 6)
        kinds = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]
    unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ModelLoadError(f"layer_types={unknown!r} is not supported (sliding_attention "
                             "and full_attention layers only)")  # fmt: skip
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"rope_parameters.sliding_attention.rope_type={local['rope_type']!r} "
                             "is not supported (the local layers' RoPE is unscaled)")  # fmt: skip
    return {
        "sliding_window": int(cfg["sliding_window"]),
        "sliding_layers": tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention"),
        "rope_local_theta": float(
            local.get("rope_theta") or cfg.get("rope_local_base_freq") or 1e4
        ),
        "hidden_act": "gelu_tanh",
        "post_norms": True,
        "embed_scale": True,
        "attention_scale": float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
        "final_logit_softcap": cfg.get("final_logit_softcapping"),
    }


def _windows(cfg: Mapping[str, Any], arch: str, layers: int) -> dict[str, Any]:
    """Sliding-window attention as transformers applies it: Mistral's and Mixtral's
    `sliding_window` on every layer; Qwen2's and Qwen3's only with `use_sliding_window`,
    on the layers `layer_types` names (transformers 5) or else from `max_window_layers`
    on. {} for global attention."""
    window = cfg.get("sliding_window")
    if not window:
        return {}
    if arch in ("mistral", "mixtral"):
        return {"sliding_window": int(window), "sliding_layers": tuple(range(layers))}
    if arch not in ("qwen2", "qwen3", "qwen3_moe") or not cfg.get("use_sliding_window"):
        return {}
    first = int(cfg.get("max_window_layers", layers))
    kinds = cfg.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(layers)
    ]
    return {
        "sliding_window": int(window),
        "sliding_layers": tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention"),
    }


def _rope_global(cfg: Mapping[str, Any], arch: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of the model's global layers; Gemma 3's transformers 5
    configs give one `rope_parameters` per layer type."""
    params = cfg.get("rope_parameters") or {}
    if arch == "gemma3" and "full_attention" in params:
        return _rope({"rope_parameters": params["full_attention"]})
    if arch == "gemma3" and not params and "rope_theta" not in cfg:
        return 1_000_000.0, _rope(cfg)[1]  # Gemma 3's global base
    return _rope(cfg)


def parse_config(cfg: Mapping[str, Any], name: str, eos_extra: list[int]) -> ModelConfig:
    """A ModelConfig from a config.json mapping (ModelLoadError when unsupported)."""
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    _refuse_unsupported(cfg, arch)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    theta, scaling = _rope_global(cfg, arch)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        eos_token_ids=tuple(dict.fromkeys(_ids(cfg.get("eos_token_id")) + eos_extra)),
        name=name,
        **_moe(cfg, arch, layers),
        **(_gemma3(cfg, layers) if arch == "gemma3" else _windows(cfg, arch, layers)),
    )


def _chat_template(root: Path, tok_cfg: Mapping[str, Any]) -> str | None:
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"cannot read {jinja}: {exc}") from exc
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _special(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_hf_dir(root: Path) -> tuple[ModelConfig, Tokenizer, dict[str, Any]]:
    """Config, tokenizer and the raw config.json of the Hugging Face directory `root`."""
    cfg = read_json(root / "config.json")
    gen_cfg = read_json(root / "generation_config.json", required=False)
    tok_cfg = read_json(root / "tokenizer_config.json", required=False)
    try:
        config = parse_config(cfg, root.name, _ids(gen_cfg.get("eos_token_id")))
    except ModelLoadError as exc:
        raise ModelLoadError(f"{root / 'config.json'}: {exc}") from exc
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{root / 'config.json'}: malformed config: {exc!r}") from exc
    tok_path = root / "tokenizer.json"
    if not tok_path.is_file():
        raise ModelLoadError(f"{tok_path} is missing (only fast tokenizers are supported)")
    eos_text = _special(tok_cfg.get("eos_token"))
    tokenizer = Tokenizer.from_file(
        tok_path,
        bos_token=_special(tok_cfg.get("bos_token")),
        eos_tokens=[eos_text] if eos_text else [],
        eos_token_ids=config.eos_token_ids,
        bos_token_id=config.bos_token_id,
        chat_template=_chat_template(root, tok_cfg),
        add_bos_token=tok_cfg.get("add_bos_token"),
    )
    config = dataclasses.replace(
        config, eos_token_ids=tokenizer.eos_token_ids, bos_token_id=tokenizer.bos_token_id
    )
    return config, tokenizer, cfg
