"""Quantized weights: each layer against a dequantize-then-matmul reference, on the native
GEMM and on PyTorch's kernels (the fallback without a C compiler), GGUF blocks against
gguf's own dequantization, the scheme plan, and a quantized engine end to end."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import ModelLoadError
from radixserve.kernels.cpu.qgemm import native_qgemm
from radixserve.model.config import ModelConfig
from radixserve.model.gguf_blocks import read_direct
from radixserve.model.gguf_file import GGUFFile
from radixserve.model.gguf_loader import GGUFWeights
from radixserve.model.qlinear import Fp8Linear, Int4Linear, Int8Linear, make_linear
from radixserve.model.quant import (
    QuantizedRows,
    RequantError,
    Target,
    dequantize,
    plan_schemes,
    quantize,
)
from tests.engine.engine_helpers import assert_no_leaks, make_engine
from tests.model.tiny_checkpoints import write_tiny_checkpoint, write_tiny_gguf

CPU = torch.device("cpu")


@pytest.fixture(params=["native", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The layers made in the test run on the native GEMM, or on PyTorch's kernels as
    where no C compiler is."""
    if request.param == "torch":
        monkeypatch.setattr("radixserve.model.qlinear.native_qgemm", lambda: None)
    elif native_qgemm() is None:
        pytest.skip("no C compiler here: no native GEMM")
    return request.param


def _bf16(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t.to(torch.bfloat16).float()


def _reference(x: torch.Tensor, rows) -> torch.Tensor:
    return x.float() @ dequantize(rows).t()


def _close(y: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    err = (y.float() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item() + 1e-3, (err, ref.abs().max().item())


_INT4_SHAPES = [
    (n, k, g) for n, k in ((64, 64), (192, 96), (576, 576), (128, 1536)) for g in (32, 64, 128)
    if k % g == 0
]  # fmt: skip


@pytest.mark.parametrize("n,k,group", _INT4_SHAPES)
def test_int4_layer_matches_dequantized_reference(n, k, group, path):
    torch.manual_seed(n + k + group)
    rows = quantize(torch.randn(n, k), "int4", group)
    layer = Int4Linear(n, k, torch.bfloat16, CPU, group)
    half = n // 2 // 64 * 64 or n  # two pieces when they fit the 64-row blocks
    layer.load(0, rows.take_rows(torch.arange(half)))
    if half < n:
        layer.load(half, rows.take_rows(torch.arange(half, n)))
    stored = QuantizedRows("int4", rows.q, _bf16(rows.scale), _bf16(rows.zero))  # as kept
    for t in (1, 3, 17, 100):
        x = torch.randn(t, k, dtype=torch.bfloat16)
        _close(layer(x), _reference(x, rows), 0.02)
        _close(layer(x), _reference(x, stored), 2**-7)


@pytest.mark.parametrize("n,k", [(64, 64), (200, 96), (576, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_and_fp8_layers_match_dequantized_reference(n, k, dtype, path):
    torch.manual_seed(n * k)
    w = torch.randn(n, k)
    for cls, scheme, rel in ((Int8Linear, "int8", 0.02), (Fp8Linear, "fp8", 0.08)):
        rows = quantize(w, scheme)
        assert (dequantize(rows) - w).abs().max() <= rows.scale.max() * (
            0.5 if scheme == "int8" else 32
        )
        layer = cls(n, k, dtype, CPU)
        third = n // 3  # pieces that do not end on the kernel's 16-row blocks
        layer.load(0, QuantizedRows(scheme, rows.q[:third], rows.scale[:third]))
        layer.load(third, QuantizedRows(scheme, rows.q[third:], rows.scale[third:]))
        for t in (1, 5, 33, 97):
            x = torch.randn(t, k, dtype=dtype)
            y = layer(x, bias=torch.ones(n, dtype=dtype))
            assert y.dtype == dtype and y.shape == (t, n)
            _close(y, _reference(x, rows) + 1, rel)
        ids = torch.tensor([0, n - 1, 3])
        torch.testing.assert_close(
            layer.rows(ids).float(), dequantize(rows)[ids], atol=0.05, rtol=0.01
        )


def test_int8_native_pads_an_odd_number_of_inputs():
    """K = 33 (PyTorch's int8 kernel returns NaN there): a zero code and a zero input."""
    if native_qgemm() is None:
        pytest.skip("no C compiler here: no native GEMM")
    torch.manual_seed(3)
    rows = quantize(torch.randn(48, 33), "int8")
    layer = Int8Linear(48, 33, torch.float32, CPU)
    layer.load(0, rows)
    x = torch.randn(5, 33)
    _close(layer(x), _reference(x, rows), 0.02)
    stored = QuantizedRows("int8", rows.q, _bf16(rows.scale))
    assert torch.equal(layer.rows(torch.arange(48)), dequantize(stored))


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_alone_and_in_a_prefill_batch(scheme, dtype, path):
    """A row computed in a prefill-sized batch and alone: the same bits (a cached turn's
    delta and a full prompt give a token the same logits), on the native GEMM by
    construction, on PyTorch's kernels as measured (tests/kernels/test_qgemm.py checks
    the native one thoroughly)."""
    torch.manual_seed(1)
    rows = quantize(torch.randn(576, 1536) * 0.05, scheme)
    layer = make_linear(scheme, 576, 1536, dtype, CPU)
    layer.load(0, rows)
    x = torch.randn(200, 1536).to(dtype)
    big, small = layer(x), layer(x[:3])
    assert torch.equal(big[:3], small)


def test_a_layer_refuses_rows_of_another_scheme():
    layer = make_linear("int4", 64, 64, torch.bfloat16, CPU)
    with pytest.raises(TypeError, match="int4 layer loads int4 rows"):
        layer.load(0, quantize(torch.randn(64, 64), "int8"))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_like_gguf(kind):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((130, 256)).astype(np.float32) * rng.uniform(0.1, 3, (130, 1)).astype(
        np.float32
    )
    raw = gguf.quants.quantize(w, GGMLQuantizationType[kind])
    expected = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(w.shape))
    errors = RequantError()
    rows = read_direct(raw, kind, 256, errors)
    got = dequantize(rows)
    if kind == "Q8_0":  # one scale per row instead of per block: within half a step
        assert rows.scheme == "int8" and errors.tensors == 1 and 0 < errors.relative_rms < 0.02
        assert ((got - expected).abs() <= rows.scale[:, None] / 2 + 1e-6).all()
    else:  # exact
        assert rows.scheme == "int4" and errors.tensors == 0
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _write_one_tensor(path, name, raw, kind) -> GGUFFile:
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


@pytest.mark.parametrize("kind,scheme,step", [("Q4_K", "int4", 1 / 15), ("Q6_K", "int8", 1 / 127)])
def test_k_quants_are_requantized_with_the_error_counted(tmp_path, kind, scheme, step):
    """Random K-quant blocks (gguf cannot quantize to K-quants) with sane f16 scales."""
    qtype = GGMLQuantizationType[kind]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (64, 512 // block * nbytes), dtype=np.uint8)
    blocks = raw.reshape(64, -1, nbytes)
    scale_at = (0, 2) if kind == "Q4_K" else (nbytes - 2,)  # f16 d (and dmin) fields
    for at in scale_at:
        blocks[..., at : at + 2] = (
            rng.uniform(0.001, 0.01, blocks.shape[:2])
            .astype(np.float16)
            .view(np.uint8)
            .reshape(*blocks.shape[:2], 2)
        )
    reader = _write_one_tensor(tmp_path / "k.gguf", "blk.0.ffn_down.weight", raw, qtype)
    config = ModelConfig("qwen2", 100, 512, 64, 1, 4, 4, 128, 1e-6, 1e4, 128, False)
    weights = GGUFWeights(tmp_path / "k.gguf", reader, config)
    assert weights.formats() == {"model.layers.0.mlp.down_proj.weight": kind}
    errors = RequantError()
    rows = weights.read_quantized("model.layers.0.mlp.down_proj.weight", scheme, errors)
    expected = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(64, 512))
    assert rows.scheme == scheme and errors.tensors == 1 and errors.relative_rms > 0
    span = expected.abs().amax() * 2
    assert (dequantize(rows) - expected).abs().max() <= span * step


def _targets() -> dict[str, Target]:
    return {
        "embed": Target((("model.embed_tokens.weight", 512),), 64, embedding=True),
        "layers.0.qkv": Target((("q", 64), ("k", 32), ("v", 32)), 64),
        "layers.0.down": Target((("d", 64),), 128),
    }


def test_plan_keeps_gguf_formats_and_refuses_what_the_device_cannot_run():
    targets = _targets()
    q4 = {"model.embed_tokens.weight": "Q4_0", "q": "Q4_1", "k": "Q4_1", "v": "Q6_K", "d": "Q4_1"}
    plan = plan_schemes("auto", CPU, targets, q4)
    assert plan == {"embed": "int8", "layers.0.qkv": "int8", "layers.0.down": "int4"}
    q8 = {**q4, "model.embed_tokens.weight": "Q8_0", "v": "Q4_1"}
    plan = plan_schemes("auto", CPU, targets, q8)  # k is 32 rows: not int4's 64-row blocks
    assert plan == {"embed": "none", "layers.0.qkv": "int8", "layers.0.down": "int4"}
    assert set(plan_schemes("auto", CPU, targets, {}).values()) == {"none"}
    assert plan_schemes("int4", CPU, targets, {})["embed"] == "int8"
    assert set(plan_schemes("none", CPU, targets, q4).values()) == {"none"}
    with pytest.raises(ModelLoadError, match="fp8 is for GPUs"):
        plan_schemes("fp8", CPU, targets, {})
    if not torch.cuda.is_available():  # what a CUDA device refuses, named without one
        with pytest.raises(ModelLoadError, match="CPU weight-only kernels"):
            plan_schemes("int4", torch.device("cuda"), targets, {})


def test_quantized_gguf_engine_is_consistent_and_small(tmp_path):
    """A Q4_1 GGUF served as int4 (qkv int8: its k/v pieces are 32 rows): greedy tokens
    equal with the cache on and off, prefill chunked or not, and weights about the file's
    tensor bytes."""
    path = write_tiny_gguf(tmp_path / "tiny-q4_1.gguf", quant="Q4_1")
    on = make_engine(str(path), quantization="auto", dtype="bfloat16", page_size=4)
    off = make_engine(str(path), quantization="auto", dtype="bfloat16", prefix_cache=False,
                      max_num_batched_tokens=16, prefill_chunk_tokens=16)  # fmt: skip
    dense = make_engine(str(path), quantization="none", dtype="bfloat16")
    assert isinstance(on.model.decoder_layers[0].gate_up, Int4Linear)
    assert isinstance(on.model.decoder_layers[0].qkv, Int8Linear)
    assert on.quantization.startswith("int4")
    assert on.model.weight_bytes < 0.6 * dense.model.weight_bytes
    shared = list(range(40, 140))
    prompts = [shared + [7, 8, 9], shared + [10, 11], list(range(200, 300))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = on.generate(prompts[:1], params)
    rest = on.generate(prompts[1:], params)
    assert rest[0].cached_tokens >= 96  # the shared prefix hit the cache
    ref = off.generate(prompts, params)
    assert [r.token_ids for r in first + rest] == [r.token_ids for r in ref]
    assert_no_leaks(on)
    assert_no_leaks(off)


def test_hf_checkpoint_quantized_at_load(tmp_path):
    tiny_hf_dir = write_tiny_checkpoint(tmp_path / "hf")
    for scheme, cls in (("int8", Int8Linear), ("int4", Int4Linear)):
        engine = make_engine(str(tiny_hf_dir), quantization=scheme, dtype="bfloat16")
        assert isinstance(engine.model.decoder_layers[0].down, cls)
        assert isinstance(engine.model.embed, Int8Linear)
        out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0))
        assert len(out[0].token_ids) == 4
