"""A Hugging Face model directory's config.json and tokenizer files (no weights, no torch:
the gateway reads these alone).

Supported architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM. RoPE
parameters are read from either the transformers 4 layout (`rope_theta` and
`rope_scaling`) or the transformers 5 one (`rope_parameters`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from radixserve.errors import ModelLoadError
from radixserve.model.config import ModelConfig, RopeScaling
from radixserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


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
    raise ModelLoadError(f"unsupported rope scaling type {kind!r}")


def parse_config(cfg: Mapping[str, Any], name: str, eos_extra: list[int]) -> ModelConfig:
    """A ModelConfig from a config.json mapping (ModelLoadError when unsupported)."""
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    if cfg.get("mlp_bias"):
        raise ModelLoadError("MLP biases (mlp_bias=true) are not supported")
    window = cfg.get("sliding_window")
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    if arch == "qwen3" and cfg.get("use_sliding_window"):  # served wrong if ignored
        raise ModelLoadError(f"use_sliding_window={cfg['use_sliding_window']!r} is not "
                             "supported for Qwen3 (sliding-window attention)")  # fmt: skip
    if (
        window
        and window < max_pos
        and arch not in ("qwen2", "qwen3")
        or arch == "qwen2"
        and window
        and window < max_pos
        and cfg.get("use_sliding_window")
    ):
        logger.warning("sliding_window=%s is ignored: attention is global", window)
    theta, scaling = _rope(cfg)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        eos_token_ids=tuple(dict.fromkeys(_ids(cfg.get("eos_token_id")) + eos_extra)),
        name=name,
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
