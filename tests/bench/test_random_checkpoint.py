"""Random weights of a given shape: reproducible, complete, and servable by the engine."""

from __future__ import annotations

import torch

from radixserve.bench.random_checkpoint import random_checkpoint
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model.checkpoint import expected_weights
from radixserve.model.config import ModelConfig
from radixserve.settings import EngineSettings

CONFIG = ModelConfig(
    architecture="llama", vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=128, tie_word_embeddings=False, name="random-test",
)  # fmt: skip


def test_weights_are_reproducible_and_complete():
    a = dict(random_checkpoint(CONFIG, seed=1).iter_weights(torch.float32))
    b = dict(random_checkpoint(CONFIG, seed=1).iter_weights(torch.float32))
    other = dict(random_checkpoint(CONFIG, seed=2).iter_weights(torch.float32))
    assert list(a) == [name for name, _ in expected_weights(CONFIG)]
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    norm = a["model.norm.weight"]
    assert (norm - 1).abs().max() < 0.5 and 0.01 < a["lm_head.weight"].std() < 0.04


def test_engine_serves_random_weights():
    settings = EngineSettings(device="cpu", dtype="float32", kv_cache_memory_gib=0.01)
    engine = Engine(settings, random_checkpoint(CONFIG))
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)
    [result] = engine.generate([[5, 6, 7, 8, 9]], params)
    assert len(result.token_ids) == 4 and all(0 <= t < 300 for t in result.token_ids)
    assert result.text.split() == [f"<{t}>" for t in result.token_ids]
    assert engine.config.name == "random-test"
