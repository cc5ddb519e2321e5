"""The decode step's fast path on CPU: every decoder layer in one native call.

A decode-only step (every sequence one new token) of a `LlamaModel` on the CPU kernel
set runs its embedding lookup and final norm + LM head as usual and all its layers
through `radixserve.kernels.cpu.decode.DecodeStep`, which computes the same bits as the
layers' torch ops (`tests/model/test_fused_decode.py` checks logits and greedy tokens
with `torch.equal`) without their per-op dispatch, allocation and thread hand-off.

A step with extends (a cached turn's delta, a short prompt, decodes beside them) of up
to `max_rows` new tokens runs there too, one native row per new token: its position,
its slot and its sequence's page-table row. The torch path computes every token's row
the same way whatever the other rows (the native GEMM never mixes rows, the attention
is batch-invariant, the norms, RoPE and silu are row-wise), so the bits are the same
(`tests/model/test_fused_extend.py`).

`fused_decode_for` decides once, at start-up, whether a model can take it; `why_not`
says why not (logged): it needs bfloat16, every layer's matrices int4 or int8 through
the native GEMM, the native attention, and the plain Llama layer (no biases, q/k norms,
extra norms, GELU, experts, sliding windows, tensor parallelism). Decode-only batches
over `max_batch`, and steps with extends over `max_rows` new tokens, run the layers in
torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from radixserve.kernels.cpu.attention import native_attention
from radixserve.kernels.cpu.decode import (
    DecodeShape,
    DecodeStep,
    LayerWeights,
    ProjWeights,
    RowRuns,
    supports,
)
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.llama import LlamaModel
from radixserve.model.qlinear import Int4Linear, Int8Linear, Linear

logger = logging.getLogger(__name__)

#: the most sequences a native step takes (its buffers are made for them at start-up);
#: larger decode batches run the torch layers, whose per-op cost they amortise and whose
#: GEMMs split over the cores (bench/decode_ab.py: even at 16 on one thread)
FUSED_MAX_BATCH = 16
#: threads of the native step: up to two, as torch's thread count allows. Two split every
#: GEMM and the attention with five barriers a layer (the same bits): at batch 16 that is
#: 0.75x the time of one thread, but at batches under `TWO_THREADS_FROM` one thread, in
#: the caller with no hand-off at all, is faster on a 2-core machine (a preempted partner
#: stalls every barrier; bench/decode_ab.py)
FUSED_THREADS = 2
TWO_THREADS_FROM = 8
#: the most new tokens of a step with extends that the native step takes: a whole prefill
#: chunk (`prefill_chunk_tokens`' default). Its buffers are made for them at start-up
#: (9.6 MB on the default model, two threads); it beat the torch layers at every size
#: measured, 16 to 512 new tokens over a 2k-token prefix (bench/extend_ab.py)
FUSED_MAX_ROWS = 512
#: rows of one sequence attended together (each K/V block read once for them): small
#: enough that one sequence's delta still splits over both threads' (run, KV head) items
RUN_ROWS = 16


def _proj(layer: Linear) -> ProjWeights | None:
    """A projection as the native step reads it, or None where it cannot."""
    if isinstance(layer, Int4Linear) and layer._qgemm is not None:
        return ProjWeights(layer.packed, layer.scales_zeros, layer.out_features,
                           layer.in_features, layer.group)  # fmt: skip
    if (
        isinstance(layer, Int8Linear)
        and layer._qgemm is not None
        and layer.out_features % 16 == 0
        and layer.in_features % 2 == 0
    ):
        return ProjWeights(layer.packed, layer.scale, layer.out_features, layer.in_features, 0)
    return None


def why_not(
    model: LlamaModel, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> str | None:
    """Why `model` cannot decode through the native step (None: it can)."""
    c = model.config
    if model.ops.name != "torch" or model.comm is not None:
        return "not the CPU kernel set on one rank"
    if c.attention_bias or c.qk_norm or c.post_norms or c.hidden_act == "gelu_tanh":
        return "a layer other than Llama's (bias, q/k norm, extra norms or GELU)"
    if c.moe_layers or c.sliding_layers:
        return "experts or sliding-window layers"
    if native_attention() is None:
        return "no native attention kernel"
    if (reason := supports(_shape(model, kv_caches))) is not None:
        return reason
    for layer in model.decoder_layers:
        if layer.input_norm.dtype != torch.bfloat16 or layer.input_norm.device.type != "cpu":
            return f"{layer.input_norm.dtype} on {layer.input_norm.device} (bfloat16 on CPU)"
        if any(_proj(p) is None for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)):
            return "a layer matrix not int4/int8 through the native GEMM"
    for k, v in kv_caches:
        if k.dtype != torch.bfloat16 or not (k.is_contiguous() and v.is_contiguous()):
            return "a KV pool other than contiguous bfloat16"
    return None


def _shape(
    model: LlamaModel, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> DecodeShape:
    c, layer = model.config, model.decoder_layers[0]
    return DecodeShape(
        hidden=c.hidden_size, heads=layer.num_heads, kv_heads=layer.num_kv_heads,
        head_dim=layer.head_dim, inter=layer.down.in_features, eps=layer.eps,
        scale=layer.scale if layer.scale is not None else layer.head_dim**-0.5,
        page_size=kv_caches[0][0].shape[1],
    )  # fmt: skip


class FusedDecode:
    """Decode-only steps of `model` through the native step (built by `fused_decode_for`)."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        threads: int,
        two_threads_from: int = TWO_THREADS_FROM,
        max_rows: int = FUSED_MAX_ROWS,
    ) -> None:
        self.model = model
        self.max_batch = max_batch  # decode-only steps
        self.max_rows = max_rows  # steps with extends: their new tokens
        self.two_threads_from = two_threads_from  # fewer rows run on one thread
        layers = []
        for layer, (k, v) in zip(model.decoder_layers, kv_caches):
            projs = [_proj(p) for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            assert all(p is not None for p in projs)
            layers.append(LayerWeights(layer.input_norm, layer.post_norm, *projs, k, v))  # type: ignore[arg-type]
        self.step = DecodeStep(_shape(model, kv_caches), layers, model.rope.cos, model.rope.sin,
                               max(max_batch, max_rows), threads)  # fmt: skip

    def applies(self, fb: ForwardBatch) -> bool:
        """Whether the native step computes this step: a decode-only step of up to
        `max_batch` sequences, or a step with extends of up to `max_rows` new tokens."""
        rows = fb.input_ids.shape[0]
        if fb.attn.num_extend_tokens == 0:
            return 0 < rows <= self.max_batch
        return rows <= self.max_rows

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """The model's logits for `fb` (as `LlamaModel.forward`), (N, vocab) float32."""
        x = self.model._embed(fb.input_ids).contiguous()  # (B, hidden)
        meta = fb.attn
        threads = 1 if x.shape[0] < self.two_threads_from else None  # None: as built
        rows = _row_runs(meta.cu_seqlens_q.tolist()) if meta.num_extend_tokens else None
        x, residual = self.step(x, fb.positions, meta.slot_mapping, meta.page_table.contiguous(),
                                threads, rows)  # fmt: skip
        return self.model.logits(x, residual, fb.logits_indices)


def _row_runs(cu_seqlens: list[int]) -> RowRuns:
    """The rows of sequences whose new tokens are rows [cu[s], cu[s + 1]): each row's
    sequence, and runs of up to `RUN_ROWS` rows of one sequence."""
    row_seq: list[int] = []
    chunks: list[int] = []
    for seq, (lo, hi) in enumerate(zip(cu_seqlens, cu_seqlens[1:])):
        row_seq.extend([seq] * (hi - lo))
        chunks.extend(range(lo, hi, RUN_ROWS))
    chunks.append(cu_seqlens[-1])
    return RowRuns(torch.tensor(row_seq, dtype=torch.int64),
                   torch.tensor(chunks, dtype=torch.int64))  # fmt: skip


def fused_decode_for(
    model: LlamaModel,
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    max_batch: int,
    threads: int,
    two_threads_from: int = TWO_THREADS_FROM,
    max_rows: int = FUSED_MAX_ROWS,
) -> FusedDecode | None:
    """The native decode step for `model`, or None (logged) where it does not apply."""
    reason = why_not(model, kv_caches)
    if reason is not None:
        logger.info("decode runs the layers in torch ops: %s", reason)
        return None
    fused = FusedDecode(model, kv_caches, max_batch, threads, two_threads_from, max_rows)
    logger.info("decode runs the layers in one native call (batches up to %d, steps with "
                "extends up to %d tokens; buffers %.1f MB)", max_batch, max_rows,
                fused.step.buffer_bytes / 1e6)  # fmt: skip
    return fused
