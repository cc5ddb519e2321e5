"""A llama.cpp GGUF file's model config and tokenizer, from its header (no weights read,
no torch: the gateway reads these alone)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf.quants import dequantize

from radixserve.errors import ModelLoadError
from radixserve.model.config import ModelConfig, RopeScaling
from radixserve.model.families.family import GGUFShape
from radixserve.model.families.registry import for_gguf
from radixserve.model.gguf_file import GGUFFile
from radixserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_GATING_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def _llama3_from_rope_freqs(freqs: np.ndarray, head_dim: int, theta: float) -> RopeScaling | None:
    """Recognise llama.cpp's precomputed `rope_freqs` as Llama 3 scaling (None if unknown)."""
    factor = float(freqs.max())
    for original in (8192, 4096, 16384, 32768):
        scaling = RopeScaling("llama3", factor, 1.0, 4.0, original)
        low_wavelen = original / scaling.low_freq_factor
        high_wavelen = original / scaling.high_freq_factor
        expected = []
        for i in range(0, head_dim, 2):
            wavelen = 2 * math.pi * theta ** (i / head_dim)
            if wavelen < high_wavelen:
                expected.append(1.0)
            elif wavelen > low_wavelen:
                expected.append(factor)
            else:
                smooth = (original / wavelen - 1.0) / (4.0 - 1.0)
                expected.append(1.0 / ((1 - smooth) / factor + smooth))
        if len(expected) == freqs.size and np.allclose(freqs, expected, rtol=1e-3):
            return scaling
    return None


def _rope_scaling(
    meta: Mapping[str, Any], arch: str, reader: GGUFFile, head_dim: int, theta: float
) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind == "linear":
        return RopeScaling("linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
    if kind not in (None, "none"):
        raise ModelLoadError(f"unsupported RoPE scaling type {kind!r}")
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            freqs = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
            scaling = _llama3_from_rope_freqs(freqs, head_dim, theta)
            if scaling is None:
                raise ModelLoadError("unrecognised rope_freqs tensor (RoPE frequency factors)")
            return scaling
    return None


def _moe(meta: Mapping[str, Any], arch: str, names: set[str], layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields: a layer is sparse where its router
    (``ffn_gate_inp``) is stored; {} for a dense model."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    gating = meta.get(f"{arch}.expert_gating_func", _GATING_SOFTMAX)
    if gating != _GATING_SOFTMAX:
        raise ModelLoadError(f"{arch}.expert_gating_func={gating!r} is not supported "
                             "(the router's top-k is over a softmax of its logits)")  # fmt: skip
    inter = meta.get(f"{arch}.expert_feed_forward_length") or meta[f"{arch}.feed_forward_length"]
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(meta[f"{arch}.expert_used_count"]),
        "moe_intermediate_size": int(inter),
        # llama.cpp renormalises both families' top-k weights unless told otherwise
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)),
        "moe_layers": tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names),
    }


def _config(meta: Mapping[str, Any], reader: GGUFFile, path: Path, tokenizer: Tokenizer):
    arch = str(meta.get("general.architecture"))  # its metadata keys' prefix
    # the family: of that arch, with experts or not (a llama file with experts is Mixtral)
    family = for_gguf(meta.get("general.architecture"), bool(meta.get(f"{arch}.expert_count")))

    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    names = {tensor.name for tensor in reader.tensors}
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise ModelLoadError(f"partial rotary embeddings ({rope_dim} of {head_dim}) unsupported")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    layers = int(need("block_count"))
    shape = GGUFShape(arch, layers, hidden, heads, head_dim)
    return ModelConfig(
        architecture=family.name,
        vocab_size=int(vocab or tokenizer.vocab_size),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=_rope_scaling(meta, arch, reader, head_dim, theta),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(meta.get("general.name") or path.stem),
        **_moe(meta, arch, names, layers),
        **family.gguf_fields(meta, shape),
    )


def read_gguf(path: Path) -> tuple[ModelConfig, Tokenizer, GGUFFile]:
    """Config, tokenizer and the opened file (its tensor table) of the GGUF file at
    `path`. Raises ModelLoadError (naming `path`) for an unreadable, truncated or
    unsupported file."""
    try:
        reader = GGUFFile(path)
        meta = reader.fields
    except Exception as exc:  # ValueError, struct.error, OSError...
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (truncated or corrupt): {exc}"
        ) from exc
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta)
        config = _config(meta, reader, path, tokenizer)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"{path}: malformed GGUF metadata: {exc}") from exc
    logger.info("GGUF %s: %s", path, config)
    return config, tokenizer, reader
