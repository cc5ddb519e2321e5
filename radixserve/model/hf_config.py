"""A Hugging Face model directory's config.json and tokenizer files (no weights, no torch:
the gateway reads these alone).

Supported architectures: the model families' (`radixserve.model.families`), each of
which adds its own fields to the common ones read here. RoPE parameters are read from either the
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
from radixserve.model.families.family import Family, refuse
from radixserve.model.families.registry import for_hf
from radixserve.model.tokenizer import Tokenizer


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


def _refuse_unsupported(cfg: Mapping[str, Any], family: Family) -> None:
    """ModelLoadError naming the first field whose value this decoder does not implement."""
    acts = family.activations
    for act in ("hidden_activation", "hidden_act"):
        if act in cfg and cfg[act] is not None and cfg[act] not in acts:
            refuse(cfg, act, f"the MLP's activation must be {' or '.join(acts)}")
    if cfg.get("mlp_bias"):
        refuse(cfg, "mlp_bias", "MLP biases")
    family.refuse_unsupported(cfg)
    if cfg.get("use_bidirectional_attention"):
        refuse(cfg, "use_bidirectional_attention", "bidirectional attention")
    for key, known in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        if cfg.get(key, known) != known:  # routing modes of other MoE families
            refuse(cfg, key, f"the router's top-k is over a {known!r} of its logits")


def parse_config(cfg: Mapping[str, Any], name: str, eos_extra: list[int]) -> ModelConfig:
    """A ModelConfig from a config.json mapping (ModelLoadError when unsupported)."""
    family = for_hf(list(cfg.get("architectures") or []))
    _refuse_unsupported(cfg, family)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    theta, scaling = _rope(family.rope_config(cfg))
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    return ModelConfig(
        architecture=family.name,
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
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.tie_by_default)),
        attention_bias=family.attention_bias or bool(cfg.get("attention_bias", False)),
        qk_norm=family.qk_norm,
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        eos_token_ids=tuple(dict.fromkeys(_ids(cfg.get("eos_token_id")) + eos_extra)),
        name=name,
        **family.hf_fields(cfg, layers),
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
