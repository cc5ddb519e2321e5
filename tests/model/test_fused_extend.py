"""Steps with extends through the native step (radixserve/model/fused_decode.py,
kernels/cpu/decode.c): a cached turn's delta of 1, 16 and 100 new tokens, alone and
beside decodes, a short prompt and a step of `FUSED_MAX_ROWS` tokens, gives logits (every new token's) and K/V `torch.equal` to the torch
path's for the same step, on one thread and two; through the engine, a cached turn's
greedy tokens equal those of the torch path with the prefix cache off.

The native step's slots for the step are poisoned with NaN before it runs: a row that
read a key of this step before its row had stored it would read NaN, not the torch
path's copy, and fail the comparison.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.kernels.cpu.native import native_library
from radixserve.model.forward_batch import ForwardBatch, SequenceChunk, build_forward_batch
from radixserve.model.fused_decode import FUSED_MAX_ROWS, FusedDecode, fused_decode_for
from radixserve.model.lora_manager import LoraBatch
from radixserve.settings import EngineSettings
from tests.engine.engine_helpers import TINY, make_engine, tiny_checkpoint

pytestmark = pytest.mark.skipif(native_library() is None, reason="no native kernels here")


def _prefill(engine: Engine, ids: list[int], pages: list[int]) -> None:
    """The first len(ids) tokens of a sequence into its pages, through the torch path."""
    fb = build_forward_batch([SequenceChunk(ids, 0, pages, True)], engine.page_size, engine.device)
    engine.model(fb.input_ids, fb.positions, engine.kv_pool.layers, fb.attn, fb.logits_indices)


def _poison(engine: Engine, fb: ForwardBatch) -> None:
    """NaN in every layer's K and V at the step's slots."""
    ps = engine.page_size
    for k, v in engine.kv_pool.layers:
        for slot in fb.attn.slot_mapping.tolist():
            k[slot // ps, slot % ps] = float("nan")
            v[slot // ps, slot % ps] = float("nan")


def _compare_step(
    engine: Engine, fused: FusedDecode, prefixes: list[int], deltas: list[int],
    wants_logits: bool = True,
) -> None:  # fmt: skip
    """Sequences of `prefixes[i]` cached tokens, then one step of `deltas[i]` new tokens
    each (extends first): the torch path, then the native one, every new token's logits
    (none: chunks that end no prompt, ``wants_logits`` False) and the pool equal."""
    model, ps, vocab = engine.model, engine.page_size, engine.config.vocab_size
    gen = torch.Generator().manual_seed(sum(prefixes) + 7 * sum(deltas))
    pages = [engine.allocator.alloc(-(-(p + d) // ps)) for p, d in zip(prefixes, deltas)]
    with torch.inference_mode():
        chunks = []
        for p, d, seq_pages in zip(prefixes, deltas, pages):
            if p:
                _prefill(engine, torch.randint(0, vocab, (p,), generator=gen).tolist(), seq_pages)
            new = torch.randint(0, vocab, (d,), generator=gen).tolist()
            chunks.append(SequenceChunk(new, p, seq_pages, wants_logits,
                                        scored_rows=d - 1 if wants_logits else 0))  # fmt: skip
        fb = build_forward_batch(chunks, ps, engine.device)
        assert fused.applies(fb)
        assert fb.attn.num_extend_tokens == sum(d for d in deltas if d > 1)
        want = model(fb.input_ids, fb.positions, engine.kv_pool.layers, fb.attn,
                     fb.logits_indices)  # fmt: skip
        assert want.shape[0] == (sum(deltas) if wants_logits else 0)  # every new token's
        pool = engine.kv_pool.kv.clone()
        _poison(engine, fb)
        got = fused.forward(fb)
        assert torch.equal(got, want), "logits differ"
        assert torch.equal(engine.kv_pool.kv.view(torch.int16), pool.view(torch.int16))
    for seq_pages in pages:
        engine.allocator.decref(seq_pages)


@pytest.fixture(scope="module")
def tiny() -> Engine:
    """The tiny model as int4 (its qkv int8: both GEMMs), bfloat16, with 6 query heads
    over 3 KV heads: an odd number, so that two threads share each row's (row, KV head)
    items and a row's keys are stored by one thread and read by the other."""
    settings = EngineSettings(
        model="default",
        device="cpu",
        load_progress=False,
        quantization="int4",
        dtype="bfloat16",
        kv_cache_memory_gib=0.05,
    )
    engine = Engine(settings, checkpoint=tiny_checkpoint(num_heads=6, num_kv_heads=3))
    assert engine.runner.fused is not None
    return engine


STEPS = {
    "delta 1": ([37], [1]),
    "delta 16": ([37], [16]),
    "delta 100": ([300], [100]),
    "a delta of 16 beside decodes": ([64, 5, 130], [16, 1, 1]),
    "two deltas and decodes": ([33, 200, 9, 70], [24, 40, 1, 1]),
    "a short prompt": ([0], [23]),
    "a step at the bound": ([40], [FUSED_MAX_ROWS]),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_tiny_model_extend_steps_equal_the_torch_path(
    tiny: Engine, step: str, threads: int
) -> None:
    prefixes, deltas = STEPS[step]
    # every step on `threads` (the engine's own picks one or two by the steps' times)
    fused = fused_decode_for(tiny.model, tiny.kv_pool.layers, 16, threads, adaptive=False)
    assert fused is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _compare_step(tiny, fused, prefixes, deltas)
    finally:
        torch.set_num_threads(before)


def test_default_model_extend_steps_equal_the_torch_path() -> None:
    engine = make_engine("default", kv_cache_memory_gib=0.1)
    fused = engine.runner.fused
    assert fused is not None
    assert fused._head() is not None  # its bfloat16 LM head: the logits come from the step
    _compare_step(engine, fused, [2048], [100])
    _compare_step(engine, fused, [500, 70, 300], [16, 1, 1])
    _compare_step(engine, fused, [0, 64], [48, 32], wants_logits=False)  # chunks of prompts


def test_steps_over_the_bound_run_the_torch_layers(tiny: Engine) -> None:
    fused = tiny.runner.fused
    assert fused is not None
    ps = tiny.page_size
    pages = tiny.allocator.alloc(-(-(fused.max_rows + 1) // ps))
    over = build_forward_batch([SequenceChunk([1] * (fused.max_rows + 1), 0, pages, True)],
                               ps, tiny.device)  # fmt: skip
    at = build_forward_batch([SequenceChunk([1] * fused.max_rows, 0, pages, True)], ps,
                             tiny.device)  # fmt: skip
    assert fused.applies(at) and not fused.applies(over)
    tiny.allocator.decref(pages)


def _count_native_steps(engine: Engine) -> dict[str, int]:
    """Counts, kept up to date, of the steps with extends the engine's native step
    computes: "extend" all of them, "mixed" those with decode rows too."""
    counts = {"extend": 0, "mixed": 0}
    fused = engine.runner.fused
    assert fused is not None
    forward = fused.forward

    def counted(fb: ForwardBatch, lora: LoraBatch | None = None) -> torch.Tensor:
        if fb.attn.num_extend_tokens:
            counts["extend"] += 1
            counts["mixed"] += fb.attn.num_extend_tokens < fb.input_ids.shape[0]
        return forward(fb, lora)

    fused.forward = counted  # type: ignore[method-assign]
    return counts


def _turns(engine: Engine, questions: list[str]) -> list[list[int]]:
    """Greedy answers of a chat, each turn's prompt the whole conversation so far."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    messages: list[dict[str, str]] = []
    answers = []
    for q in questions:
        messages.append({"role": "user", "content": q})
        [out] = engine.generate([engine.tokenizer.encode_chat(messages)], params)
        answers.append(out.token_ids)
        messages.append({"role": "assistant", "content": engine.tokenizer.decode(out.token_ids)})
    return answers


def test_a_cached_chat_gives_the_tokens_of_the_torch_path_with_the_cache_off() -> None:
    questions = ["Name a colour.", "Why that one? " * 8, "And its opposite, in a sentence " * 12]
    settings = dict(quantization="int4", dtype="bfloat16", kv_cache_memory_gib=0.05)
    cached = make_engine(TINY, fused_decode=True, prefix_cache=True, **settings)
    off = make_engine(TINY, fused_decode=False, prefix_cache=False, **settings)
    counts = _count_native_steps(cached)
    got, want = _turns(cached, questions), _turns(off, questions)
    assert got == want and all(len(a) == 20 for a in got)
    assert counts["extend"] >= len(questions)  # every turn's delta took the native step


def test_an_extend_beside_decodes_in_the_engine_gives_the_cache_off_tokens() -> None:
    """One request decoding while a cached turn's delta arrives: steps mixing an extend
    with decode rows, through the native step, against the torch path, cache off."""
    settings = dict(quantization="int4", dtype="bfloat16", kv_cache_memory_gib=0.05)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    results, counts = [], {}
    for fused, cache in ((True, True), (False, False)):
        engine = make_engine(TINY, fused_decode=fused, prefix_cache=cache, **settings)
        if fused:
            counts = _count_native_steps(engine)
        base = engine.tokenizer.encode("A long shared preamble about ships and harbours. " * 6)
        engine.generate([base], params)  # caches the preamble (cache on)
        engine.add_request(base + [5, 6, 7], params, request_id="early")
        tokens: dict[str, list[int]] = {}
        for step in itertools.count():
            if step == 4:  # "early" decodes by now
                late = base + engine.tokenizer.encode(" and lighthouses " * 6)
                engine.add_request(late, params, request_id="late")
            elif step > 4 and not engine.has_unfinished():
                break
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        results.append(tokens)
    assert results[0] == results[1] and all(len(t) == 30 for t in results[0].values())
    assert counts["mixed"] >= 1
