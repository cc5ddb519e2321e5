"""The default model (SmolLM2-135M-Instruct GGUF) against transformers' own GGUF loading."""

from __future__ import annotations

import pytest
import torch

from tests.engine.engine_helpers import assert_greedy_matches_transformers, chunked_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(smol_float32, hf_smol, prompt):
    ids = smol_float32.tokenizer.encode(prompt)
    ours = chunked_logits(smol_float32, ids)
    with torch.inference_mode():
        ref = hf_smol(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_generation_matches_transformers(smol_float32, hf_smol):
    prompts = [smol_float32.tokenizer.encode(p) for p in PROMPTS]
    assert_greedy_matches_transformers(smol_float32, hf_smol, prompts, 24)
