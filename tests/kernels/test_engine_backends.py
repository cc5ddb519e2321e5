"""The engine's greedy outputs are identical on the torch and the triton kernel sets
(interpreted on CPU here), on a tiny random Llama with 3 q heads per kv head and
llama3 rope scaling: a prefill after a cached prefix, a step mixing a prefill with
running decodes, and decodes."""

from __future__ import annotations

import pytest

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import assert_no_leaks, make_engine
from tests.model.tiny_checkpoints import write_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=5, min_tokens=5, temperature=0.0)
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
    monkeypatch.setattr(cpu_decode, "MIN_VIEW_PAGES", 2)
    engine = make_engine(str(checkpoint), attention_backend="torch", **common)
    assert engine.model.ops.decode_attention is cpu_decode.decode_attention
    fast_run = _scenario(engine)
    monkeypatch.setattr("radixserve.kernels.cpu.OPS", reference.OPS)
    engine = make_engine(str(checkpoint), attention_backend="torch", **common)
    assert engine.model.ops.decode_attention is reference.decode_attention
    assert _scenario(engine) == fast_run
