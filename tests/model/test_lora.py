"""PEFT LoRA adapters served by the engine (radixserve/model/lora.py, lora_manager.py).

Tiny random-init models of each family the decoder serves through its dense layers
(Llama, Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms, Gemma 3 with its sliding
windows and norms around attention and MLP), and adapters made with ``peft`` here: "qv"
(rank 8 on q_proj and v_proj) and "all" (rank 16 on all seven projections, rsLoRA), their
A and B random so each changes the answer. The engine runs in float32 (as the families'
comparison with transformers does) and its greedy tokens equal transformers + peft's,
each adapter alone and all in one batch beside the base model. Pages of one adapter never
serve another (the adapter's fingerprint is in the page namespace), those of the same
adapter's content do, whatever its name; the base model's are as before.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import InvalidRequestError, ModelLoadError, UnknownAdapterError
from radixserve.settings import EngineSettings
from tests.engine.engine_helpers import FLOAT32, assert_no_leaks
from tests.model.tiny_checkpoints import build_tiny_model, write_tiny_checkpoint

peft = pytest.importorskip("peft")

FAMILIES = {
    "llama": {"arch": "llama"},
    "qwen2": {"arch": "qwen2", "attention_bias": True},
    "qwen3": {"arch": "qwen3", "tie": False, "head_dim": 32},
    # five sliding layers (window 8) and a global one: prompts longer than the window
    "gemma3": {"arch": "gemma3", "tie": True, "num_hidden_layers": 6, "sliding_window": 8,
               "head_dim": 16, "query_pre_attn_scalar": 16, "final_logit_softcapping": 30.0},
}  # fmt: skip
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "qv": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all": {"r": 16, "lora_alpha": 8, "target_modules": ALL, "use_rslora": True},
}
NEW_TOKENS = 12
SMALL = {"page_size": 4, "kv_cache_memory_gib": 0.01, "device": "cpu", "load_progress": False}


def _prompts(n: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 512, (length,), generator=g).tolist() for length in (21, 6)[:n]]


def peft_model(kwargs: dict, adapter: dict, seed: int):  # type: ignore[no-untyped-def]
    """The tiny base model with a LoRA adapter of ``adapter`` (`peft.LoraConfig`'s
    arguments) on it, its A and B random."""
    config = peft.LoraConfig(**adapter, lora_dropout=0.0)
    model = peft.get_peft_model(build_tiny_model(**kwargs), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(0.15 * torch.randn(param.shape, generator=g))
    return model.eval()


def peft_reference(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def tiny_family(
    name: str, kwargs: dict[str, Any], adapters: Mapping[str, Any], root: Path
) -> tuple[str, Path, dict[str, Path], dict[str, Any]]:
    """(name, model directory, {adapter: directory}, {"": base, adapter: peft model}) of
    the tiny model ``kwargs`` and ``adapters`` (name → `peft_model`'s spec), written
    under ``root``."""
    models = {"": build_tiny_model(**kwargs)}
    dirs = {}
    for seed, (adapter, spec) in enumerate(adapters.items()):
        models[adapter] = peft_model(kwargs, spec, seed)
        models[adapter].save_pretrained(root / adapter)
        dirs[adapter] = root / adapter
    return name, write_tiny_checkpoint(root / "model", **kwargs), dirs, models


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """`tiny_family` of each family here, with every adapter."""
    return tiny_family(request.param, FAMILIES[request.param], ADAPTERS,
                       tmp_path_factory.mktemp(request.param))  # fmt: skip


def _engine(model_dir: Path, dirs: dict[str, Path], **overrides) -> Engine:
    modules = tuple(f"{name}={path}" for name, path in dirs.items())
    return Engine(EngineSettings(model=str(model_dir), lora_modules=modules,
                                 **{**SMALL, **overrides}))  # fmt: skip


def run_jobs(engine: Engine, jobs: list[tuple[list[int], str]], n: int = NEW_TOKENS):
    """Greedy tokens and cached prompt tokens of (prompt, adapter) jobs, run as one batch."""
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
    ids = [engine.add_request(prompt, params, adapter=adapter) for prompt, adapter in jobs]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                cached[out.request_id] = out.cached.total
    return [tokens[i] for i in ids], [cached[i] for i in ids]


def test_adapter_tokens_equal_peft_alone_and_mixed(family):
    """Each family's greedy tokens with an adapter equal transformers + peft's: "all"
    alone, then both prompts under the base model and both adapters in one batch (its
    rows interleaved: each row must get its own adapter); every adapter changes them."""
    _, model_dir, dirs, models = family
    engine = _engine(model_dir, dirs, **FLOAT32)
    prompts = _prompts()
    want = {(i, a): peft_reference(m, p) for i, p in enumerate(prompts) for a, m in models.items()}
    alone, _ = run_jobs(engine, [(prompts[0], "all")])
    assert alone[0] == want[0, "all"]
    jobs = [(i, a) for i in range(len(prompts)) for a in ("", "qv", "all")]
    got, _ = run_jobs(engine, [(prompts[i], a) for i, a in jobs])
    assert got == [want[job] for job in jobs]
    for i in range(len(prompts)):  # the adapters do change the answer
        assert want[i, "qv"] != want[i, ""] and want[i, "all"] != want[i, ""]
    assert_no_leaks(engine)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Llama's model directory and adapters (no reference models)."""
    root = tmp_path_factory.mktemp("llama_lora")
    dirs = {}
    for seed, name in enumerate(ADAPTERS):
        peft_model(FAMILIES["llama"], ADAPTERS[name], seed).save_pretrained(root / name)
        dirs[name] = root / name
    return write_tiny_checkpoint(root / "model", **FAMILIES["llama"]), dirs


def test_cache_is_per_adapter_and_on_equals_off(llama):
    """With the engine's default dtype: cache on gives cache off's tokens; the same
    prompt on another adapter (or the base model) finds no cached token, on the same
    adapter (or a copy of it under another name: same content) its prefix."""
    model_dir, dirs = llama
    prompt = _prompts(1)[0]
    jobs = [(prompt, a) for a in ("qv", "all", "")]
    off, _ = run_jobs(_engine(model_dir, dirs, prefix_cache=False), jobs)
    engine = _engine(model_dir, dirs)
    engine.load_lora("qv-copy", str(dirs["qv"]))
    first, _ = run_jobs(engine, [(prompt, "qv")])
    assert first[0] == off[0]
    for adapter, want in (("all", off[1]), ("", off[2])):  # another identity: nothing cached
        tokens, cached = run_jobs(engine, [(prompt, adapter)])
        assert (tokens[0], cached[0]) == (want, 0), adapter
    for adapter, want in (("qv", off[0]), ("qv-copy", off[0]), ("all", off[1]), ("", off[2])):
        tokens, cached = run_jobs(engine, [(prompt, adapter)])
        assert tokens[0] == want and cached[0] >= len(prompt) - 4, (adapter, cached)
    assert_no_leaks(engine)


def test_adapters_beyond_the_slots_wait_and_are_swapped_in(llama):
    """max_loras 1: requests of two adapters and the base model, queued together, run
    one adapter at a time (the other copied into the slot when the first is done) and
    answer as each alone does."""
    model_dir, dirs = llama
    prompts = _prompts()
    jobs = [(p, a) for p in prompts for a in ("qv", "all", "")]
    want = [run_jobs(_engine(model_dir, dirs), [job])[0][0] for job in jobs[:3]]
    engine = _engine(model_dir, dirs, max_loras=1, prefix_cache=False)
    got, _ = run_jobs(engine, jobs)
    assert got[:3] == want
    assert len(engine.loras.resident) == 1 and engine.loras.num_loads >= 2
    assert_no_leaks(engine)


def test_speculation_verifies_with_the_adapter(llama):
    """Drafts from a request's own tokens are verified with its adapter: the tokens are
    those decoding one by one gives (a draft verified by the base model would differ)."""
    model_dir, dirs = llama
    prompt = _prompts(1)[0] * 3  # its n-grams repeat: drafts to verify
    jobs = [(prompt, "all"), (prompt, "qv"), (prompt, "")]
    want, _ = run_jobs(_engine(model_dir, dirs, prefix_cache=False), jobs, 24)
    engine = _engine(model_dir, dirs, prefix_cache=False, speculative_method="prompt")
    # how far it drafts: fixed (a row a tenth of a one-row step)
    engine.speculator.cost.seconds = lambda most: [9.0 + r for r in range(1, most + 1)]
    for job, tokens in zip(jobs, want):
        assert run_jobs(engine, [job], 24)[0][0] == tokens
    assert engine.speculator.stats["prompt"].accepted > 0


def test_the_native_decode_step_adds_the_adapters(llama):
    """Steps with adapter rows run the native decode step, which adds their updates
    itself: the greedy tokens are those of the torch layers (and not the base model's),
    each adapter alone and both beside the base model in one batch
    (`tests/model/test_lora_fused.py` compares the logits)."""
    model_dir, dirs = llama
    prompts = _prompts()
    fused = _engine(model_dir, dirs, dtype="bfloat16", quantization="int4", fused_decode=True)
    if fused.runner.fused is None:
        pytest.skip("no native decode step on this machine")
    plain = _engine(model_dir, dirs, dtype="bfloat16", quantization="int4", fused_decode=False)
    native = fused.runner.fused
    adapter_steps = []
    forward = native.forward

    def counted(fb, lora=None):  # type: ignore[no-untyped-def]
        adapter_steps.append(lora is not None)
        return forward(fb, lora)

    native.forward = counted  # type: ignore[method-assign]
    base = run_jobs(plain, [(prompts[0], "")])[0][0]
    for adapter in ("all", "qv"):  # alone: every decode step has one adapter row
        tokens = run_jobs(fused, [(prompts[0], adapter)])[0][0]
        assert tokens == run_jobs(plain, [(prompts[0], adapter)])[0][0] and tokens != base
    mixed = [(p, a) for p in prompts for a in ("", "qv", "all")]
    assert run_jobs(fused, mixed)[0] == run_jobs(plain, mixed)[0]
    assert sum(adapter_steps) >= 3 * NEW_TOKENS


def _copy_adapter(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_dora": True}, "use_dora=True"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out=True"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "['embed_tokens']"),
        ({"r": 4}, "expected (4, 64)"),  # the tensors are of rank 8: named, with the shape
        ({"r": 8, "lora_alpha": 16, "use_rslora": False}, None),  # as saved: loads
    ],
)
def test_unsupported_adapters_are_refused_by_name(llama, tmp_path, change, named):
    model_dir, dirs = llama
    engine = _engine(model_dir, {})
    path = _copy_adapter(dirs["qv"], tmp_path / "adapter", **change)
    if named is None:
        assert engine.load_lora("ok", str(path)).scaling == 2.0
        return
    with pytest.raises(ModelLoadError, match=re.escape(named)):
        engine.load_lora("bad", str(path))
    assert "bad" not in engine.loras.adapters


def test_rank_over_max_lora_rank_is_refused_at_load(llama):
    model_dir, dirs = llama
    with pytest.raises(ModelLoadError, match=r"rank r=16, over max_lora_rank=8"):
        _engine(model_dir, dirs, max_lora_rank=8)
    engine = _engine(model_dir, {"qv": dirs["qv"]}, max_lora_rank=8)  # rank 8 fits
    assert list(engine.loras.adapters) == ["qv"]
    with pytest.raises(ModelLoadError, match="max_lora_rank=8"):
        engine.load_lora("all", str(dirs["all"]))


def test_adapters_on_experts_and_wrong_shapes_are_refused_naming_the_tensor(tmp_path):
    """Hand-written adapter files: one on a mixture-of-experts layer's expert, one whose
    B is the wrong height for the projection."""
    kwargs = {"arch": "qwen3_moe", "tie": False, "head_dim": 32, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32}  # fmt: skip
    engine = Engine(EngineSettings(model=str(write_tiny_checkpoint(tmp_path / "m", **kwargs)),
                                   **SMALL))  # fmt: skip
    cases = {
        "model.layers.0.mlp.experts.1.gate_proj": ((4, 64), (32, 4), "targets an expert"),
        "model.layers.1.self_attn.k_proj": ((4, 64), (128, 4), r"expected \(64, 4\)"),
    }
    for module, (a_shape, b_shape, named) in cases.items():
        path = tmp_path / module
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                              "lora_alpha": 8}))  # fmt: skip
        key = f"base_model.model.{module}"
        save_file({f"{key}.lora_A.weight": torch.zeros(a_shape),
                   f"{key}.lora_B.weight": torch.zeros(b_shape)},
                  str(path / "adapter_model.safetensors"))  # fmt: skip
        with pytest.raises(ModelLoadError, match=named) as info:
            engine.load_lora("x", str(path))
        assert module in str(info.value)


def test_unknown_adapters_are_refused_and_unloading(llama):
    """A request naming no loaded adapter is refused naming it; an adapter a live request
    uses is refused unloading until the request ends; one not in use unloads, and its
    name is then unknown."""
    model_dir, dirs = llama
    engine = _engine(model_dir, dirs)
    with pytest.raises(UnknownAdapterError, match="'nope'") as info:
        engine.add_request([5, 6, 7], adapter="nope")
    assert isinstance(info.value, ValueError) and info.value.param == "model"
    with pytest.raises(UnknownAdapterError):
        engine.unload_lora("nope")
    rid = engine.add_request(_prompts(1)[0], SamplingParams(max_tokens=4), adapter="qv")
    engine.step()
    with pytest.raises(InvalidRequestError, match=f"in use by 1 request.*{rid}"):
        engine.unload_lora("qv")
    engine.unload_lora("all")  # not in use: unloads
    with pytest.raises(UnknownAdapterError, match="'all'"):
        engine.add_request([5, 6, 7], adapter="all")
    while engine.has_unfinished():
        engine.step()
    engine.unload_lora("qv")
    assert engine.loras.adapters == {} and not engine.loras.resident
    assert_no_leaks(engine)


def test_async_engine_streams_with_an_adapter(llama):
    """`AsyncEngine.stream` (what `radixserve serve` runs on) passes the adapter on: the
    streamed tokens are the engine's with it; an unknown name raises before any output."""
    model_dir, dirs = llama
    prompt = _prompts(1)[0]
    want = run_jobs(_engine(model_dir, dirs), [(prompt, "all")])[0][0]
    front = AsyncEngine(lambda: _engine(model_dir, dirs))
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)

    async def stream(adapter: str) -> list[int]:
        return [t async for out in front.stream(prompt, params, adapter=adapter)
                for t in out.new_token_ids]  # fmt: skip

    try:
        assert asyncio.run(stream("all")) == want
        with pytest.raises(UnknownAdapterError, match="'nope'"):
            asyncio.run(stream("nope"))
    finally:
        front.close()


def test_lora_settings_are_checked():
    for bad, named in (({"lora_modules": ["a"]}, "NAME=PATH"),
                       ({"lora_modules": ["a=/x", "a=/y"]}, "twice"),
                       ({"lora_modules": ["a=/x"], "tp": 2}, "tp > 1"),
                       ({"max_loras": 0}, "max_loras")):  # fmt: skip
        with pytest.raises(ValueError, match=named):
            EngineSettings(**bad)
