"""Reading a llama.cpp GGUF file's weights (its config and tokenizer: `gguf_config`).

Weights are memory-mapped by `GGUFFile` and dequantised one tensor at a time
(`gguf.quants.dequantize`) under Hugging Face Llama names. llama.cpp's converter
permutes the rows of Q and K (and their biases) for llama-arch models (Mixtral
included: `Family.gguf_permuted_qk`) from Hugging Face's rotate-half layout to
interleaved pairs; `_unpermute_rows` undoes that, so the weights work with rotate-half
RoPE. Other families' files are stored unpermuted.

A mixture-of-experts layer stores its experts stacked, one tensor per projection
(``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``: (E, rows, inputs)) and its router
as ``ffn_gate_inp``; each expert's slice is served under its Hugging Face name
(the family's `TensorNames`: Mixtral's ``block_sparse_moe.experts.{e}.w1``, Qwen3-MoE's
``mlp.experts.{e}.gate_proj``)
and read by itself, quantized blocks included.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize

from radixserve.model.config import ModelConfig
from radixserve.model.families.family import Family
from radixserve.model.families.registry import by_name
from radixserve.model.gguf_blocks import read_direct
from radixserve.model.gguf_config import read_gguf
from radixserve.model.gguf_file import GGUFFile, GGUFTensor
from radixserve.model.quant import DIRECT_TYPES, QuantizedRows, RequantError, Scheme
from radixserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# MoE tensors: GGUF part → which of the family's expert projections (gate, up, down)
_EXPERT_PARTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, family: Family) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors we do not use."""
    if m := _BLOCK_RE.match(gguf_name):
        layer, part, kind = m.groups()
        names = {**_BLOCK_NAMES, **family.names.gguf_blocks}
        return f"model.layers.{layer}.{names[part]}.{kind}" if part in names else None
    if (m := _GLOBAL_RE.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def _moe_names(gguf_name: str, config: ModelConfig) -> list[str]:
    """The Hugging Face names a MoE tensor serves: the router's one, or one per expert
    of a stacked projection ([] for any other tensor)."""
    m = _BLOCK_RE.match(gguf_name)
    if m is None or not config.moe_layers:
        return []
    layer, part, _ = m.groups()
    names = by_name(config.architecture).names
    block = f"model.layers.{layer}.{names.moe_block}"
    if part == "ffn_gate_inp":
        return [f"{block}.gate.weight"]
    if part not in _EXPERT_PARTS:
        return []
    proj = names.experts[_EXPERT_PARTS[part]]
    return [f"{block}.experts.{e}.{proj}.weight" for e in range(config.num_experts)]


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: interleaved rotary pairs → rotate-half halves."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeights:
    """Lazy access to the tensors of an open GGUF file under Hugging Face names."""

    def __init__(self, path: Path, reader: GGUFFile, config: ModelConfig) -> None:
        self.path = path
        self._config = config
        family = by_name(config.architecture)
        self._permuted_qk = family.gguf_permuted_qk
        self._tensors = {n: t for t in reader.tensors if (n := hf_name(t.name, family)) is not None}
        self._expert: dict[str, int] = {}  # an expert's name → its index in its stack
        for t in reader.tensors:
            for e, name in enumerate(_moe_names(t.name, config)):
                self._tensors[name] = t
                if len(t.shape) == 3:
                    self._expert[name] = e

    def names(self) -> set[str]:
        return set(self._tensors)

    def formats(self) -> dict[str, str]:
        """Each tensor's GGUF type name ("Q4_1", "F32", ...)."""
        return {name: t.tensor_type.name for name, t in self._tensors.items()}

    def _heads(self, name: str) -> int | None:
        """The head count whose rows llama.cpp permuted in `name`, or None."""
        cfg = self._config
        if self._permuted_qk:
            if ".self_attn.q_proj." in name:
                return cfg.num_heads
            if ".self_attn.k_proj." in name:
                return cfg.num_kv_heads
        return None

    def read(self, name: str) -> torch.Tensor:
        """The float32 CPU tensor `name` in Hugging Face layout (KeyError if absent)."""
        tensor, raw = self._raw(name)
        shape = tuple(int(d) for d in reversed(tensor.shape))[-raw.ndim :]  # an expert's 2
        data = dequantize(raw, tensor.tensor_type).reshape(shape)
        if (heads := self._heads(name)) is not None:
            data = _unpermute_rows(data, heads)
        data = np.ascontiguousarray(data, dtype=np.float32)
        if not data.flags.writeable:  # an F32 tensor is a view of the read-only memory map
            data = data.copy()
        return torch.from_numpy(data)

    def read_quantized(self, name: str, scheme: Scheme, errors: RequantError) -> QuantizedRows:
        """The 2-D tensor `name` in `scheme`: Q4_0/Q4_1 as int4 and Q8_0 as int8 from
        their blocks; anything else dequantized and quantized (the error counted)."""
        tensor, raw = self._raw(name)
        kind = tensor.tensor_type.name
        k = int(tensor.shape[0])
        if DIRECT_TYPES.get(kind) != scheme:
            return errors.requantize(kind, self.read(name), scheme)
        rows = read_direct(raw, kind, k, errors)
        if (heads := self._heads(name)) is not None:
            index = torch.from_numpy(_unpermute_rows(np.arange(rows.shape[0]), heads).copy())
            rows = rows.take_rows(index)
        return rows

    def _raw(self, name: str) -> tuple[GGUFTensor, np.ndarray]:
        """The tensor `name` is in, and its data (an expert's slice of a stack)."""
        tensor = self._tensors[name]
        e = self._expert.get(name)
        return tensor, tensor.data if e is None else tensor.data[e]


def load_gguf(path: Path) -> tuple[ModelConfig, Tokenizer, GGUFWeights]:
    """Config, tokenizer and lazy weights of the GGUF file at `path`.

    Raises ModelLoadError (naming `path`) for an unreadable, truncated or unsupported file.
    """
    config, tokenizer, reader = read_gguf(path)
    return config, tokenizer, GGUFWeights(path, reader, config)
