"""The engine's logits and greedy tokens equal Hugging Face transformers on the same weights.

Tiny random checkpoints of each supported family are written in HF safetensors format,
loaded by both, and compared in fp32.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.engine_helpers import (
    FLOAT32,
    assert_greedy_matches_transformers,
    chunked_logits,
    make_engine,
)
from tests.model.tiny_checkpoints import write_tiny_checkpoint

VARIANTS = {
    "llama-tied": {"arch": "llama", "tie": True},
    "llama-untied-rope-llama3": {
        "arch": "llama",
        "tie": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2-qkv-bias": {"arch": "qwen2", "tie": False},
    "mistral": {"arch": "mistral", "tie": False},
    # q/k norms per head; head_dim 32, not hidden / heads = 16
    "qwen3-qk-norm": {"arch": "qwen3", "tie": False, "head_dim": 32},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return make_engine(str(path), page_size=4, **FLOAT32), hf


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("n", [1, 7, 33])
def test_prompt_logits_match_transformers(pair, n):
    engine, hf = pair
    ids = _ids(n, engine.config.vocab_size)
    ours = chunked_logits(engine, ids)
    torch.testing.assert_close(ours, _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("split", [4, 9, 32])
def test_paged_prefix_and_decode_paths_match(pair, split):
    """A prefix read back from pages (page-aligned or not) and the decode path give the
    logits of a single full pass."""
    engine, hf = pair
    ids = _ids(33, engine.config.vocab_size, seed=split)
    torch.testing.assert_close(
        chunked_logits(engine, ids, split=split), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4
    )


def test_greedy_generation_matches_transformers(pair):
    engine, hf = pair
    prompts = [_ids(n, engine.config.vocab_size, seed=n) for n in (5, 12, 19)]
    assert_greedy_matches_transformers(engine, hf, prompts, 16)
