"""LoRA adapters in the native decode step (kernels/cpu/decode.c, fused_decode.py): the
logits of every step with adapter rows, and the K/V it writes, `torch.equal` to the torch
layers' (`ops.lora_apply` after each projection), over batches of 1 to 9 rows mixing the
base model and three adapters (ranks 4 to 16, on all seven projections or a few, so some
projections are adapted for some rows only), int4 and int8 projections, 1 and 2 threads.
And the adapter stacks' rank: the largest loaded adapter's, the same bits as at a larger
one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from radixserve.engine.engine import Engine
from radixserve.kernels.cpu.native import native_library
from radixserve.model.forward_batch import SequenceChunk, build_forward_batch
from radixserve.model.fused_decode import FusedDecode, fused_decode_for
from radixserve.model.lora import segments
from tests.engine.engine_helpers import TINY, make_engine

pytestmark = pytest.mark.skipif(native_library() is None, reason="no native kernels here")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: name → (rank, targets): partial targets leave other rows' slots zero in a projection
ADAPTERS = {
    "qv": (8, ("q_proj", "v_proj")),
    "all": (16, ALL),
    "mlp": (4, ("o_proj", "gate_proj", "down_proj")),
}
#: each step's rows' adapters ("": the base model)
BATCHES = [["all"], ["", "qv"], ["mlp", "", "all", "qv"],
           ["qv", "all", "", "mlp", "all", "", "qv", "mlp", ""]]  # fmt: skip


def _write_adapter(path: Path, engine: Engine, rank: int, targets: tuple[str, ...], seed: int):
    """A random PEFT adapter for the engine's model, large enough to move the answers."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, seg in segments(engine.config).items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] in targets:
            a = torch.randn(rank, seg.in_features, generator=gen) * seg.in_features**-0.5
            tensors[f"base_model.model.{module}.lora_A.weight"] = a  # (r, in)
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(
                seg.width, rank, generator=gen
            )  # (out, r)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=["int4", "int8"])
def tiny(request, tmp_path_factory) -> Engine:
    """The tiny model (int4: its qkv int8, both GEMMs; or int8) with the adapters loaded."""
    engine = make_engine(TINY, quantization=request.param, dtype="bfloat16",
                         kv_cache_memory_gib=0.05, max_loras=4)  # fmt: skip
    assert engine.runner.fused is not None
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        engine.load_lora(name, str(_write_adapter(root / name, engine, rank, targets, seed)))
    return engine


def _compare_steps(engine: Engine, fused: FusedDecode | None, adapters: list[str],
                   steps: int) -> list[torch.Tensor]:  # fmt: skip
    """Prefill a sequence per entry of ``adapters`` (with its adapter, all in one step),
    then decode them together: each step through the torch layers, then the same step
    through the native one (which rewrites the same KV slots): logits and pool equal,
    and not the base model's. The torch layers' logits of each decode step."""
    ps = engine.page_size
    vocab = engine.config.vocab_size
    lens = [3 + 7 * i for i in range(len(adapters))]  # row i's prompt: the same in any batch
    ids = [torch.randint(0, vocab, (n + 1,), generator=torch.Generator().manual_seed(i))
           for i, n in enumerate(lens)]  # fmt: skip
    pages = [engine.allocator.alloc(-(-(n + steps) // ps)) for n in lens]
    logits = []
    with torch.inference_mode():
        chunks = [SequenceChunk(prompt[:n].tolist(), 0, p, True)
                  for p, n, prompt in zip(pages, lens, ids)]  # fmt: skip
        _step(engine, fused, chunks, adapters, lens)  # a step with extends
        tokens = [int(prompt[-1]) for prompt in ids]
        for step in range(steps):
            chunks = [SequenceChunk([t], n + step, p, True) for t, n, p in zip(tokens, lens, pages)]
            want = _step(engine, fused, chunks, adapters, [1] * len(lens))
            logits.append(want)
            tokens = want.argmax(-1).tolist()
    for p in pages:
        engine.allocator.decref(p)
    return logits


def _step(engine: Engine, fused: FusedDecode | None, chunks: list[SequenceChunk],
          adapters: list[str], rows: list[int]) -> torch.Tensor:  # fmt: skip
    """One step's logits through the torch layers, and the same through the native step
    (when given): equal, and equal the base model's in the base rows only."""
    model, pool = engine.model, engine.kv_pool
    fb = build_forward_batch(chunks, engine.page_size, engine.device)
    lora = engine.loras.batch(list(zip(adapters, rows)))
    assert lora is not None
    fb = dataclasses.replace(fb, lora_slots=lora.row_slot)
    want = model(fb.input_ids, fb.positions, pool.layers, fb.attn, fb.logits_indices, lora)
    if fused is not None:
        kv = pool.kv.clone()
        assert fused.applies(fb)
        got = fused.forward(fb, lora)
        assert torch.equal(got, want), "logits differ"
        assert torch.equal(pool.kv.view(torch.int16), kv.view(torch.int16))
        base = model(fb.input_ids, fb.positions, pool.layers, fb.attn, fb.logits_indices)
        pool.kv.copy_(kv)  # the base model's K/V of this step out again
        for row, adapter in enumerate(adapters):  # every adapter moves its row
            assert torch.equal(base[row], want[row]) == (adapter == ""), row
    return want


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("adapters", BATCHES, ids=lambda a: f"{len(a)}rows")
def test_adapter_steps_equal_the_torch_layers(tiny: Engine, adapters: list[str], threads: int):
    fused = fused_decode_for(tiny.model, tiny.kv_pool.layers, 16, threads, adaptive=False)
    assert fused is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _compare_steps(tiny, fused, adapters, steps=4)
    finally:
        torch.set_num_threads(before)


def test_the_stacks_rank_is_the_largest_loaded_and_pads_to_the_same_bits(
    tiny: Engine, tmp_path: Path
) -> None:
    """The stacks' R is 16 (the largest loaded rank, not max_lora_rank 64); an adapter
    of rank 64 loaded beside them remakes them at 64, the other adapters' bits the same
    (native step and torch layers alike); unloading it makes them 16 again. One native
    step throughout: it follows the stacks as they are remade and their slots written."""
    loras = tiny.loras
    assert loras.max_rank == 64 and loras.rank == 16
    rows = BATCHES[-1]
    fused = fused_decode_for(tiny.model, tiny.kv_pool.layers, 16, 2, adaptive=False)
    assert fused is not None
    want = _compare_steps(tiny, fused, rows, steps=3)
    generation = loras.generation
    tiny.load_lora("wide", str(_write_adapter(tmp_path / "wide", tiny, 64, ALL, seed=9)))
    try:
        assert loras.rank == 64 and loras.generation > generation
        assert all(stack.a.shape[1] == 64 for stack in loras._stacks.values())
        got = _compare_steps(tiny, fused, rows, steps=3)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        # the wide adapter in a step (its slot filled): the others' rows still the same
        wide = _compare_steps(tiny, fused, [*rows, "wide"], steps=3)
        assert all(torch.equal(g[:-1], w) for g, w in zip(wide, want))
    finally:
        tiny.unload_lora("wide")
    assert loras.rank == 16
    assert all(stack.a.shape[1] == 16 for stack in loras._stacks.values())
    got = _compare_steps(tiny, fused, rows, steps=3)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
