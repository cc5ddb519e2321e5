"""The engine's greedy outputs are identical on the torch and the triton kernel sets
(interpreted on CPU here), on a tiny random Llama with 3 q heads per kv head and
llama3 rope scaling: a prefill after a cached prefix, a step mixing a prefill with
running decodes, and decodes; and on Gemma 3 (sliding windows) and Qwen3-MoE (experts)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import assert_no_leaks, make_engine
from tests.model.tiny_checkpoints import write_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=5, min_tokens=5, temperature=0.0)
THREE = SamplingParams(max_tokens=3, min_tokens=3, temperature=0.0)
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-gqa"), tie=False, rope_scaling=ROPE,
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
    )  # fmt: skip


def _prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 500 for i in range(n)]


def _scenario(engine: Engine) -> dict[str, object]:
    """Token ids of each phase, and what the steps held."""
    steps: list[tuple[int, ...]] = []
    run = engine.runner.run

    def recording_run(batch):
        steps.append(tuple(batch.num_new_tokens))
        return run(batch)

    engine.runner.run = recording_run  # type: ignore[method-assign]
    context = _prompt(13, 1)  # ends mid-page (page_size 4)
    first = engine.generate([context + _prompt(3, 2)], GREEDY)[0]
    cached = engine.generate([context + _prompt(6, 3)], GREEDY)[0]
    # Two requests decode while a third one's prompt arrives: one mixed step.
    ids = [engine.add_request(_prompt(n, 10 + n), GREEDY) for n in (9, 1)]
    produced = engine.step()
    ids.append(engine.add_request(_prompt(11, 4), GREEDY))
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    while True:
        for out in produced:
            outputs[out.request_id] += out.new_token_ids
        if not engine.has_unfinished():
            break
        produced = engine.step()
    assert_no_leaks(engine)
    return {
        "first": first.token_ids,
        "cached": (cached.token_ids, cached.cached_tokens),
        "batch": [outputs[i] for i in ids],
        "steps": steps,
    }


def test_greedy_outputs_identical_on_both_kernel_sets(checkpoint, device):
    common = {"page_size": 4, "kv_cache_memory_gib": 0.01, "device": device.type}
    torch_run = _scenario(make_engine(str(checkpoint), attention_backend="torch", **common))
    triton_engine = make_engine(str(checkpoint), attention_backend="triton", **common)
    assert triton_engine.model.ops.name == "triton"
    assert triton_engine.runner.graphs is None
    triton_run = _scenario(triton_engine)
    assert triton_run == torch_run
    assert torch_run["cached"][1] == 12  # the context's full pages came from the cache
    mixed = [s for s in torch_run["steps"] if any(n > 1 for n in s) and 1 in s]
    assert mixed, torch_run["steps"]  # a step held a prefill chunk and decodes
    assert all(len(tokens) == GREEDY.max_tokens for tokens in torch_run["batch"])


def test_cpu_decode_keeps_the_reference_greedy_outputs(checkpoint, monkeypatch):
    # The torch set's CPU decode (runs of two pages or more read in place here, so both
    # its paths run) against the same engine with the reference decode.
    import importlib

    from radixserve.kernels import reference

    cpu_decode = importlib.import_module("radixserve.kernels.cpu.decode_attention")
    common = {"page_size": 4, "kv_cache_memory_gib": 0.01, "device": "cpu"}
    monkeypatch.setattr(cpu_decode, "BLOCK_TOKENS", 8)  # blocks of two pages
    # the set's decode where the native kernels are not built (they are here)
    gathered = replace(reference.OPS, decode_attention=cpu_decode.decode_attention)
    monkeypatch.setattr("radixserve.kernels.cpu.OPS", gathered)
    engine = make_engine(str(checkpoint), attention_backend="torch", **common)
    assert engine.model.ops.decode_attention is cpu_decode.decode_attention
    fast_run = _scenario(engine)
    monkeypatch.setattr("radixserve.kernels.cpu.OPS", reference.OPS)
    engine = make_engine(str(checkpoint), attention_backend="torch", **common)
    assert engine.model.ops.decode_attention is reference.decode_attention
    assert _scenario(engine) == fast_run


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_model_families_identical_on_both_kernel_sets(family, tmp_path, device):
    """Gemma 3's sliding layers (a window of 8, shorter than the cached context) through
    each set's windowed attention, and Qwen3-MoE's experts through each set's fused MoE."""
    from tests.engine.test_families import FAMILIES

    # two layers (a sliding one and a global one; a sparse one and a dense one): the
    # interpreter runs each op at Python speed
    two = {"gemma3": {"layer_types": ["sliding_attention", "full_attention"]},
           "qwen3_moe": {"mlp_only_layers": [1]}}[family]  # fmt: skip
    path = str(
        write_tiny_checkpoint(tmp_path, **{**FAMILIES[family], "num_hidden_layers": 2, **two})
    )
    common = {"page_size": 4, "kv_cache_memory_gib": 0.01, "device": device.type}
    runs = []
    for backend in ("torch", "triton"):
        engine = make_engine(path, attention_backend=backend, **common)
        context = _prompt(13, 1)  # then a prefix of 12 cached: longer than Gemma's window
        first = engine.generate([context + _prompt(3, 2)], THREE)[0]
        cached = engine.generate([context + _prompt(6, 3)], THREE)[0]
        assert cached.cached_tokens == 12
        runs.append((first.token_ids, cached.token_ids))
    assert runs[0] == runs[1]
