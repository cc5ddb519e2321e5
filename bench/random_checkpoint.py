"""A checkpoint of random weights for any `ModelConfig`: a real model's shape without its
files, for benchmarks on machines the weights cannot travel to.

Weights are reproducible on one device (each tensor's generator is seeded from `seed` and
its name): norms near 1, matrices and embeddings N(0, 0.02²). They are drawn on
`device` — on a GPU an 8B-parameter model takes seconds instead of a minute of CPU time. The tokenizer is a word-level
vocabulary `<0>`, `<1>`, ... that decodes every id; prompts are given as token ids.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import tokenizers
import torch

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
