"""Without the native CPU kernels (no C compiler, nothing prebuilt: PyTorch's weight-only
kernels and attention) the default model, with default settings, computes the same
function as with them: both stay equally close to the float32 model at every position of
every prompt (a fallback is a second implementation: it gets the same end-to-end check
as the path it stands in for; an int4 path that read its weights scrambled, as one did
on AVX2 machines, lands far off).

They are not the same bits: both multiply by the exact weight and add in float32, in
different orders, and each bfloat16 rounding of an activation then drifts on its own
(measured here: the two agree on the next token at 94-100 % of positions, each agrees
with float32 at 97-100 %). Only the native kernels promise a token's bits do not depend
on batching, chunking or the cache (tests/kernels/test_qgemm.py, test_cpu_attention.py).

Each prompt is its own request, so its prefill runs alone with as many rows as it has
tokens: short, 17-96 and >96 rows.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.engine import Engine
from radixserve.kernels.cpu.native import native_library
from radixserve.model.qlinear import Int4Linear
from tests.engine.engine_helpers import chunked_logits, make_engine

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
MIN_COSINE = 0.98  # of a position's logits and float32's (measured: 0.988 and up)
MIN_TOP1 = 0.94  # positions whose most likely next token is float32's (measured: 0.969 up)


def _default_engine() -> Engine:
    """The default model and settings (int4 on this GGUF), but for the prefix cache: off,
    so that every prompt prefills all its rows (the chats share a system prompt)."""
    return make_engine("default", kv_cache_memory_gib=0.1, prefix_cache=False)


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    """(with the native kernels, without them: built as on a machine without a compiler)."""
    native_library.cache_clear()  # cached, and read when the layers are made
    try:
        if native_library() is None:
            pytest.skip("no native kernels here (no C compiler): nothing to compare")
        native = _default_engine()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RADIXSERVE_NATIVE_KERNELS", "0")
            native_library.cache_clear()
            torch_ops = _default_engine()
    finally:
        native_library.cache_clear()
    return native, torch_ops


def _int4_layers(engine: Engine) -> list[Int4Linear]:
    return [m for m in engine.model.modules() if isinstance(m, Int4Linear)]


@pytest.mark.slow
def test_both_paths_stay_as_close_to_float32(engines, smol_float32):
    native, torch_ops = engines
    assert _int4_layers(native) and all(layer._qgemm for layer in _int4_layers(native))
    assert not any(layer._qgemm for layer in _int4_layers(torch_ops))
    prompts = [native.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    prompts += [native.tokenizer.encode(c) for c in COMPLETIONS]
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] <= 16 and lengths[-1] > 96 and any(20 <= n <= 90 for n in lengths)
    for prompt in prompts:
        want = chunked_logits(smol_float32, prompt)
        for engine in (native, torch_ops):
            got = chunked_logits(engine, prompt)
            cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
            top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            assert cosine.min() >= MIN_COSINE and top1 >= MIN_TOP1, (len(prompt), top1)
