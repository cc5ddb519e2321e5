"""The int4 prefill without the native dequantizer (no C compiler: torch ops) gives the
same greedy tokens as with it, on the default model with default settings (a fallback is
a second implementation: it gets the same end-to-end check as the path it stands in for).

Each prompt is its own request, so its prefill runs alone with as many rows as it has
tokens (a batch would add them up, a cached prefix take some off): short, 17-96 and >96
rows, around the int4 layers' crossover from the packed kernel to dequantize + dense
matmul (16 rows; without the routine it was 96, and 4 of these 6 prompts came out
different).
"""

from __future__ import annotations

import pytest

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model.native import native_dequant
from radixserve.model.qlinear import Int4Linear
from tests.engine.engine_helpers import make_engine

CHATS = [
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in two sentences why the sky is blue, and mention what Rayleigh scattering "
    "is, who described it first, and why sunsets look red or orange instead of blue.",
]
COMPLETIONS = [
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived an "
    "old woodcutter and his three children. Every morning",
    "def merge_sort(items):\n    "
    + "# split the list in two halves, sort each one, merge\n    " * 9,
]


def _default_engine() -> Engine:
    """The default model and settings (int4 on this GGUF), but for the prefix cache: off,
    so that every prompt prefills all its rows (the chats share a system prompt)."""
    return make_engine("default", dtype="auto", quantization="auto", kv_cache_memory_gib=0.1,
                       prefix_cache=False)  # fmt: skip


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    """(with the native routine, without it: built as on a machine without a compiler)."""
    native_dequant.cache_clear()  # lru-cached, and read when the int4 layers are made
    try:
        if native_dequant() is None:
            pytest.skip("no native int4 dequantizer here (no C compiler): nothing to compare")
        native = _default_engine()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RADIXSERVE_NATIVE_KERNELS", "0")
            native_dequant.cache_clear()
            torch_ops = _default_engine()
    finally:
        native_dequant.cache_clear()
    return native, torch_ops


def _int4_layers(engine: Engine) -> list[Int4Linear]:
    return [m for m in engine.model.modules() if isinstance(m, Int4Linear)]


@pytest.mark.slow
def test_same_greedy_tokens_with_and_without_native_dequantizer(engines):
    native, torch_ops = engines
    assert _int4_layers(native) and all(layer._native for layer in _int4_layers(native))
    assert not any(layer._native for layer in _int4_layers(torch_ops))
    prompts = [native.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    prompts += [native.tokenizer.encode(c) for c in COMPLETIONS]
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] <= 16 and lengths[-1] > 96 and any(20 <= n <= 90 for n in lengths)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    differ = []
    for prompt in prompts:  # one at a time: each prefill has its own number of rows
        ours = native.generate([prompt], params)[0].token_ids
        theirs = torch_ops.generate([prompt], params)[0].token_ids
        if ours != theirs:
            differ.append(
                (len(prompt), native.tokenizer.decode(ours), torch_ops.tokenizer.decode(theirs))
            )
    assert not differ, differ
