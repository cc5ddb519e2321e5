"""A checkpoint of random weights for any `ModelConfig`: a real model's shape without its
files, for benchmarks on machines the weights cannot travel to.

Weights are reproducible on one device (each tensor's generator is seeded from `seed` and
its name): norms near 1, matrices and embeddings N(0, 0.02²). They are drawn on
`device` — on a GPU an 8B-parameter model takes seconds instead of a minute of CPU time. The tokenizer is a word-level
vocabulary `<0>`, `<1>`, ... that decodes every id; prompts are given as token ids.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import save_file

from radixserve.model.checkpoint import Checkpoint, expected_weights
from radixserve.model.config import ModelConfig
from radixserve.model.tokenizer import Tokenizer


class RandomWeights:
    """A `WeightSource` that makes each tensor on demand."""

    def __init__(
        self, config: ModelConfig, seed: int, device: torch.device, fan_in: bool = False
    ) -> None:
        """``fan_in``: matrices N(0, 1/fan-in) and embeddings N(0, 1) instead of
        N(0, 0.02²), so each layer mixes as much as the residual carries and greedy text
        depends on the whole context (the engine tests' tiny model)."""
        self.path = Path(f"random:{config.name}")
        self._shapes = dict(expected_weights(config))
        self._seed = seed
        self._device = device
        self._fan_in = fan_in

    def names(self) -> set[str]:
        return set(self._shapes)

    def read(self, name: str) -> torch.Tensor:
        gen = torch.Generator(self._device)
        gen.manual_seed(self._seed * 1_000_003 + zlib.crc32(name.encode()))
        x = torch.randn(self._shapes[name], generator=gen, device=self._device)
        if name.endswith("norm.weight"):
            return 1.0 + 0.05 * x
        if not self._fan_in:
            return 0.02 * x
        return x if "embed" in name or x.dim() != 2 else x / x.shape[-1] ** 0.5


def random_tokenizer(vocab_size: int) -> Tokenizer:
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<0>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend)


def random_checkpoint(
    config: ModelConfig, seed: int = 0, device: torch.device | str = "cpu"
) -> Checkpoint:
    """Random weights of `config`'s shape; pass it to `Engine(settings, checkpoint)`."""
    source = RandomWeights(config, seed, torch.device(device))
    return Checkpoint(config, random_tokenizer(config.vocab_size), source.path, source, False)


def save_model(checkpoint: Checkpoint, root: Path, dtype: torch.dtype | None = None) -> Path:
    """``checkpoint`` written as a Hugging Face directory (config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json with its chat template) that processes load by
    path (``--model root``): random weights for tensor-parallel ranks and worker
    processes, which load the model themselves. ``dtype``: the tensors' (default: as
    the source makes them)."""
    config, tokenizer = checkpoint.config, checkpoint.tokenizer
    root.mkdir(parents=True, exist_ok=True)
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
    }  # fmt: skip
    (root / "config.json").write_text(json.dumps(hf_config, indent=1))
    source = checkpoint.source
    weights = {}
    for name in source.names():
        tensor = source.read(name)
        weights[name] = (tensor if dtype is None else tensor.to(dtype)).cpu().contiguous()
    save_file(weights, root / "model.safetensors")
    (root / "tokenizer.json").write_text(tokenizer.to_json())

    def text(token: int | None) -> str | None:
        return None if token is None else tokenizer.decode([token], skip_special_tokens=False)

    tok_config = {"bos_token": text(config.bos_token_id),
                  "eos_token": text(config.eos_token_ids[0] if config.eos_token_ids else None),
                  "chat_template": tokenizer.chat_template}  # fmt: skip
    (root / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    return root
