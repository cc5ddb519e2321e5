"""The native decode step (radixserve/model/fused_decode.py, kernels/cpu/decode.c) computes
the same bits as the layers' torch ops: the logits of every decode step, and the K/V it
writes, `torch.equal` to the torch path's, over batch sizes, contexts of one page to
several, thread counts, the prefix cache on and off, and int4 and int8 projections.

The pieces that must round as torch does are checked alone too, where a rare difference
would hide in the model's bfloat16 roundings: the float sum of the norm (torch's
cascade order), and the silu table (torch's own silu, applied as the model applies it).
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.kernels.cpu.decode import silu_table, sum_lanes
from radixserve.kernels.cpu.native import native_library
from radixserve.model.forward_batch import SequenceChunk, build_forward_batch
from radixserve.model.fused_decode import FusedDecode, ThreadChoice, fused_decode_for, why_not
from tests.engine.engine_helpers import TINY, make_engine

pytestmark = pytest.mark.skipif(native_library() is None, reason="no native kernels here")


@pytest.mark.parametrize("size", [16, 64, 100, 576, 960, 2048, 4096, 8192])
def test_the_norms_sum_is_torchs_sum_bit_for_bit(size: int) -> None:
    lib = native_library()
    assert lib is not None
    lanes = sum_lanes(576)
    assert lanes is not None
    lib.decode_sum.restype = ctypes.c_float
    lib.decode_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    gen = torch.Generator().manual_seed(size)
    scale = torch.logspace(-3, 3, 200).unsqueeze(1)
    squares = ((torch.randn(200, size, generator=gen) * scale).to(torch.bfloat16).float()) ** 2
    got = torch.tensor([lib.decode_sum(r.data_ptr(), size, lanes) for r in squares])
    assert torch.equal(got, squares.sum(-1))


def test_the_silu_table_is_torchs_silu_as_the_model_applies_it() -> None:
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(5, 2 * 1536, generator=gen) * 6).to(torch.bfloat16)
    gate = gate_up[:, :1536]  # a strided view, as the model's chunk of gate_up
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -88.0, 88.0])
    gate[0, : len(specials)] = specials.to(torch.bfloat16)

    def bits(x: torch.Tensor) -> torch.Tensor:  # compared as bits: NaN is NaN
        return x.contiguous().view(torch.int16).long() & 0xFFFF

    assert torch.equal(bits(silu_table()[bits(gate)]), bits(F.silu(gate)))


def _compare_steps(engine: Engine, fused: FusedDecode, lens: list[int], steps: int) -> None:
    """Prefill sequences of `lens` tokens through the torch path, then decode them
    together for `steps` steps: each step through the torch path, then the same step
    through the native one (which rewrites the same KV slots): logits and pool equal."""
    model, ps = engine.model, engine.page_size
    gen = torch.Generator().manual_seed(sum(lens))
    vocab = engine.config.vocab_size
    pages = [engine.allocator.alloc(-(-(n + steps) // ps)) for n in lens]
    with torch.inference_mode():
        for p, n in zip(pages, lens):
            ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
            fb = build_forward_batch([SequenceChunk(ids, 0, p, True)], ps, engine.device)
            model(fb.input_ids, fb.positions, engine.kv_pool.layers, fb.attn, fb.logits_indices)
        tokens = torch.randint(0, vocab, (len(lens),), generator=gen).tolist()
        for step in range(steps):
            chunks = [SequenceChunk([t], n + step, p, True) for t, n, p in zip(tokens, lens, pages)]
            fb = build_forward_batch(chunks, ps, engine.device)
            assert fused.applies(fb)
            want = model(fb.input_ids, fb.positions, engine.kv_pool.layers, fb.attn,
                         fb.logits_indices)  # fmt: skip
            pool = engine.kv_pool.kv.clone()
            got = fused.forward(fb)
            assert torch.equal(got, want), f"step {step}: logits differ"
            assert torch.equal(engine.kv_pool.kv.view(torch.int16), pool.view(torch.int16))
            tokens = want.argmax(-1).tolist()
    for p in pages:
        engine.allocator.decref(p)


@pytest.fixture(scope="module")
def tiny() -> Engine:
    """The tiny model as int4 (its qkv int8: both GEMMs), bfloat16."""
    engine = make_engine(TINY, quantization="int4", dtype="bfloat16", kv_cache_memory_gib=0.05)
    assert engine.runner.fused is not None
    return engine


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[1], [17], [5, 16, 33], [40, 1, 15, 16, 64, 3, 7, 100, 2]])
def test_tiny_model_logits_equal_the_torch_path(
    tiny: Engine, lens: list[int], threads: int
) -> None:
    # every batch on `threads` (the engine's own picks one or two by the steps' times)
    fused = fused_decode_for(tiny.model, tiny.kv_pool.layers, 16, threads, adaptive=False)
    assert fused is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _compare_steps(tiny, fused, lens, steps=12)
    finally:
        torch.set_num_threads(before)


def test_default_model_logits_equal_the_torch_path() -> None:
    engine = make_engine("default", kv_cache_memory_gib=0.1)
    fused = engine.runner.fused
    assert fused is not None, why_not(engine.model, engine.kv_pool.layers)
    assert fused._head() is not None  # its bfloat16 LM head: the logits come from the step
    _compare_steps(engine, fused, [3, 70, 300, 16], steps=6)
    _compare_steps(engine, fused, [129], steps=6)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_the_engine_decodes_the_same_tokens_with_and_without_it(prefix_cache: bool) -> None:
    """Greedy generations of a batch (a shared system prompt, so cached prefixes with
    the cache on) through the engine: the same tokens with the native step as without."""
    outs = []
    for fused in (True, False):
        engine = make_engine(TINY, quantization="int4", dtype="bfloat16", fused_decode=fused,
                             prefix_cache=prefix_cache, kv_cache_memory_gib=0.05)  # fmt: skip
        assert (engine.runner.fused is not None) == fused
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        prompts = [f"You are terse. Question {i}: " + "why " * i for i in range(6)]
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=f"r{i}")
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        outs.append(tokens)
    assert outs[0] == outs[1] and all(len(t) == 40 for t in outs[0].values())


def test_models_it_cannot_take_run_the_torch_layers() -> None:
    dense = make_engine(TINY, dtype="bfloat16", kv_cache_memory_gib=0.05)  # no quantization
    assert dense.runner.fused is None
    assert "int4/int8" in (why_not(dense.model, dense.kv_pool.layers) or "")
    f32 = make_engine(TINY, quantization="int4", dtype="float32", kv_cache_memory_gib=0.05)
    assert f32.runner.fused is None


def test_the_thread_choice_takes_the_faster_and_sees_the_load_change():
    choice = ThreadChoice(explore=4, window=5)
    kind = (1, False, False)

    def run(seconds: dict[int, float], steps: int, stalls: tuple[int, ...] = ()) -> list[int]:
        picks = []
        for i in range(steps):
            threads = choice.pick(kind)
            picks.append(threads)
            stalled = threads == 2 and i in stalls  # a step whose partner was preempted
            choice.record(kind, threads, 0.050 if stalled else seconds[threads])
        return picks

    picks = run({1: 0.007, 2: 0.006}, 40, stalls=(10, 11))  # quiet, the two close
    assert picks[:2] == [1, 2]  # each tried once first
    # the other every 4th step, and the stalled step does not turn the choice
    assert picks[8:].count(2) == 24 and picks[8:].count(1) == 8
    # another process takes a core: two threads stall (3x one's time): back to one, and
    # two (far behind) tried every 16th step only
    picks = run({1: 0.010, 2: 0.030}, 40)
    assert picks[-20:].count(2) == 2 and picks[-32:].count(2) == 2
    # it leaves: two threads are faster again, seen through those tries
    picks = run({1: 0.010, 2: 0.006}, 80)
    assert picks[-16:].count(2) == 15 and picks[-16:].count(1) == 1
    # kinds are apart: a step with extends, of 16 rows, or with adapter rows, has been
    # tried on neither
    assert choice.pick((1, True, False)) == 1 and choice.pick((16, False, False)) == 1
    assert choice.pick((1, False, True)) == 1
    fresh = ThreadChoice()
    assert [fresh.pick((5, True, False)), fresh.pick((5, True, False))] == [1, 1]
    fresh.record((4, True, False), 1, 0.01)  # 4 and 5 rows are one kind (rounded down to 4)
    assert fresh.pick((5, True, False)) == 2
