"""Shared helpers for engine tests: build engines, run the model on a prompt directly."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from radixserve.bench.random_checkpoint import RandomWeights, save_model
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model.checkpoint import Checkpoint, load_checkpoint
from radixserve.model.forward_batch import SequenceChunk, build_forward_batch
from radixserve.settings import EngineSettings

#: `make_engine`'s name for a random-init two-layer Llama that reads and writes text with
#: the default model's tokenizer: the engine's mechanics (cache on = off, eviction,
#: preemption, resume, forks) at a hundredth of the default model's cost per step. What
#: only the real weights show (equality with transformers, the model's text) uses "default".
TINY = "tiny"


@functools.cache
def tiny_checkpoint(
    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128
) -> Checkpoint:
    """Two layers of random weights, the default model's tokenizer; 4 query and 2 KV
    heads unless asked for others (the tensor-parallel tests split 8 and 4)."""
    real = load_checkpoint("default", progress=False)  # config and tokenizer; no weights read
    config = dataclasses.replace(
        real.config, name="tiny-smollm2", hidden_size=64, intermediate_size=intermediate_size,
        num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16,
        tie_word_embeddings=False,
    )  # fmt: skip
    source = RandomWeights(config, seed=0, device=torch.device("cpu"), fan_in=True)
    return Checkpoint(config, real.tokenizer, source.path, source, progress=False)


#: The configuration of the comparisons with another implementation (transformers in
#: float32, the Triton kernels): float32 weights and compute. Every other test runs the
#: engine's defaults, as a user gets them (bfloat16 where the CPU computes it natively,
#: the GGUF's int4 weights on the default model).
FLOAT32 = {"dtype": "float32", "quantization": "none"}


def make_engine(model: str, **overrides) -> Engine:
    settings = {"device": "cpu", "load_progress": False}
    settings.update(overrides)
    if model == TINY:
        return Engine(EngineSettings(model="default", **settings), checkpoint=tiny_checkpoint())
    return Engine(EngineSettings(model=model, **settings))


@torch.inference_mode()
def chunked_logits(engine: Engine, ids: list[int], split: int | None = None) -> torch.Tensor:
    """Next-token logits (n, vocab) for every position of `ids`, through the paged path.

    With `split`, tokens [0, split) are computed first and [split, n) in a second pass
    that reads the first part's KV from the pages; with split == n - 1 the last token
    goes through the batched decode path.
    """
    n = len(ids)
    pages = engine.allocator.alloc(-(-n // engine.page_size))
    try:
        chunks = [(0, n)] if split is None else [(0, split), (split, n)]
        rows = []
        for lo, hi in chunks:
            # every row's logits: a one-token chunk takes the decode path
            fb = build_forward_batch(
                [SequenceChunk(ids[lo:hi], lo, pages, True)], engine.page_size, engine.device
            )
            logits_indices = torch.arange(hi - lo)
            rows.append(
                engine.model(
                    fb.input_ids, fb.positions, engine.kv_pool.layers, fb.attn, logits_indices
                )
            )
        return torch.cat(rows)
    finally:
        engine.allocator.decref(pages)


def assert_no_leaks(engine: Engine) -> None:
    """No live request, nothing locked, no page reserved, and every used page owned by
    the cache."""
    stats = engine.cache_stats()
    assert stats["live_requests"] == 0, stats
    assert not engine.has_unfinished()
    if engine.cache is not None:
        engine.cache.check_integrity()
        assert stats["pages_locked"] == 0, stats
        assert stats["pages_used"] == stats["pages_cached"], stats
        assert stats["cache_locks"] == 0, stats
    else:
        assert stats["pages_used"] == 0, stats
    assert stats["page_refs_outside_cache"] == 0, stats
    assert stats["pages_reserved"] == 0, stats  # every reservation returned
    engine.check_integrity()  # the allocator's, the tree's and the cache manager's accounts


def assert_greedy_matches_transformers(engine: Engine, hf_model, prompts: list[list[int]], n: int):
    """Greedy tokens of `prompts` run as one engine batch equal transformers.generate's,
    `n` tokens each (EOS suppressed on both sides by min tokens)."""
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
    ours = engine.generate(prompts, params)
    for prompt, result in zip(prompts, ours):
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        assert result.token_ids == out[0, len(prompt) :].tolist()


def write_tiny_model(root: Path, ckpt: Checkpoint | None = None) -> Path:
    """`tiny_checkpoint()` (or ``ckpt``) saved as a Hugging Face directory (config.json,
    safetensors, the default model's tokenizer and chat template) that worker processes
    load by path: the cluster tests whose subject is the machinery (membership, faults,
    drain, tier capacity), not the model's text. Same prompts, same pages, same answers
    as the in-process tiny engine."""
    return save_model(ckpt or tiny_checkpoint(), root)
