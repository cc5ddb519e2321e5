"""Deterministic English-like prompt tokens for the engine benchmarks."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine
    from radixserve.model.tokenizer import Tokenizer

_WORDS = [
    "the",
    "system",
    "cache",
    "prompt",
    "model",
    "token",
    "request",
    "server",
    "memory",
    "page",
    "tree",
    "prefix",
    "shared",
    "context",
    "answer",
    "question",
    "user",
    "document",
    "search",
    "result",
    "value",
    "compute",
    "layer",
    "batch",
    "time",
    "first",
    "latency",
    "decode",
    "prefill",
    "worker",
    "transfer",
    "store",
    "index",
    "route",
    "load",
    "scale",
    "policy",
    "data",
    "river",
    "mountain",
    "city",
    "garden",
    "library",
    "music",
    "history",
    "science",
    "market",
    "energy",
    "network",
    "design",
]


def synthetic_tokens(engine: Engine, num_tokens: int, seed: int) -> list[int]:
    """Exactly `num_tokens` token ids of deterministic English-like text."""
    return synthetic_ids(engine.tokenizer, num_tokens, seed)


def synthetic_ids(tokenizer: Tokenizer, num_tokens: int, seed: int) -> list[int]:
    """Exactly `num_tokens` token ids of deterministic English-like text, by `tokenizer`."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < num_tokens:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(12)).capitalize() + ". "
        ids.extend(tokenizer.encode(sentence, add_special_tokens=False))
    return ids[:num_tokens]
