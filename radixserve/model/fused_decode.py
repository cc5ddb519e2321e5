"""The decode step's fast path on CPU: every decoder layer in one native call.

A decode-only step (every sequence one new token) of a `LlamaModel` on the CPU kernel
set runs its embedding lookup as usual and all its layers through
`radixserve.kernels.cpu.decode.DecodeStep`, which computes the same bits as the layers'
torch ops (`tests/model/test_fused_decode.py` checks logits and greedy tokens with
`torch.equal`) without their per-op dispatch, allocation and thread hand-off. Where the
LM head is a bfloat16 matrix the native GEMM holds (SmolLM2's tied embedding), the final
norm and the head run in the same call (`LlamaModel.logits`' bits; else that method).

A step with extends (a cached turn's delta, a short prompt, decodes beside them) of up
to `max_rows` new tokens runs there too, one native row per new token: its position,
its slot and its sequence's page-table row. The torch path computes every token's row
the same way whatever the other rows (the native GEMM never mixes rows, the attention
is batch-invariant, the norms, RoPE and silu are row-wise), so the bits are the same
(`tests/model/test_fused_extend.py`).

A step with LoRA adapter rows runs there too: each projection's output gets its rows'
updates inside the native call (lora.c's kernel, the bits of the layers'
``ops.lora_apply``; `tests/model/test_lora_fused.py`), from the `LoraManager`'s stacks,
which the step is handed again only when they change (their ``generation``).

`fused_decode_for` decides once, at start-up, whether a model can take it; `why_not`
says why not (logged): it needs bfloat16, every layer's matrices int4 or int8 through
the native GEMM, the native attention, and the plain Llama layer (no biases, q/k norms,
extra norms, GELU, experts, sliding windows, tensor parallelism). Decode-only batches
over `max_batch`, and steps with extends over `max_rows` new tokens, run the layers in
torch.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Sequence

import torch

from radixserve.kernels.cpu.attention import native_attention
from radixserve.kernels.cpu.decode import (
    LORA_PROJS,
    DecodeShape,
    DecodeStep,
    HeadWeights,
    LayerWeights,
    LoraWeights,
    ProjWeights,
    RowRuns,
    supports,
)
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.llama import LlamaModel
from radixserve.model.lora_manager import LoraBatch
from radixserve.model.qlinear import DenseLinear, Int4Linear, Int8Linear, Linear

logger = logging.getLogger(__name__)

#: the most sequences a native step takes (its buffers are made for them at start-up);
#: larger decode batches run the torch layers, whose per-op cost they amortise and whose
#: GEMMs split over the cores (bench/decode_ab.py: even at 16 on one thread)
FUSED_MAX_BATCH = 16
#: threads of the native step: up to two, as torch's thread count allows. Two split every
#: GEMM and the attention with six barriers a layer (the same bits): on a quiet 2-core
#: machine that beats one thread from batch 1 (the attention splits a sequence's q heads
#: between them), but a partner preempted by another process stalls every barrier, and
#: then one thread, in the caller with no hand-off at all, is twice as fast. Which one a
#: step takes is learnt from the steps' own times (`ThreadChoice`), for steps of fewer
#: than `CHOSEN_BELOW` rows; larger ones, where two threads win even on a busy machine
#: and trying one would cost most, take two.
FUSED_THREADS = 2
CHOSEN_BELOW = 8
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
        adaptive: bool = True,
        max_rows: int = FUSED_MAX_ROWS,
    ) -> None:
        self.model = model
        self.max_batch = max_batch  # decode-only steps
        self.max_rows = max_rows  # steps with extends: their new tokens
        # None: every step on the threads it was built for
        self.choice = ThreadChoice() if adaptive and threads > 1 else None
        layers = []
        for layer, (k, v) in zip(model.decoder_layers, kv_caches):
            projs = [_proj(p) for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            assert all(p is not None for p in projs)
            layers.append(LayerWeights(layer.input_norm, layer.post_norm, *projs, k, v))  # type: ignore[arg-type]
        self.step = DecodeStep(_shape(model, kv_caches), layers, model.rope.cos, model.rope.sin,
                               max(max_batch, max_rows), threads)  # fmt: skip
        self._lora_generation: tuple[int, int] | None = None  # the stacks `step` reads

    def applies(self, fb: ForwardBatch) -> bool:
        """Whether the native step computes this step: a decode-only step of up to
        `max_batch` sequences, or a step with extends of up to `max_rows` new tokens
        (adapter rows or not)."""
        rows = fb.input_ids.shape[0]
        if fb.attn.num_extend_tokens == 0:
            return 0 < rows <= self.max_batch
        return rows <= self.max_rows

    def forward(self, fb: ForwardBatch, lora: LoraBatch | None = None) -> torch.Tensor:
        """The model's logits for `fb` (as `LlamaModel.forward`), (N, vocab) float32; with
        ``lora`` (the step's adapters, `fb.lora_slots` its rows'), each projection's
        output gets its rows' adapter updates, as the torch layers add them."""
        assert (lora is None) == (fb.lora_slots is None)
        if lora is not None:
            self._use_loras(lora)
        x = self.model._embed(fb.input_ids).contiguous()  # (B, hidden)
        meta = fb.attn
        rows = _row_runs(meta.cu_seqlens_q.tolist()) if meta.num_extend_tokens else None
        kind = (x.shape[0], rows is not None, lora is not None)
        threads = min(self.step.threads, torch.get_num_threads())  # as built, at most
        choice = self.choice if threads > 1 and x.shape[0] < CHOSEN_BELOW else None
        if choice is not None:
            threads = choice.pick(kind)
        began = time.perf_counter()
        head = self._head()
        x, residual, logits = self.step(x, fb.positions, meta.slot_mapping,
                                        meta.page_table.contiguous(), threads, rows,
                                        fb.lora_slots, head, fb.logits_indices.contiguous())  # fmt: skip
        if choice is not None:
            choice.record(kind, threads, time.perf_counter() - began)
        return self.model.logits(x, residual, fb.logits_indices) if logits is None else logits

    def _head(self) -> HeadWeights | None:
        """The final norm and LM head for the native step, where the model's head is a
        plain bfloat16 matrix the native GEMM holds (else None: `LlamaModel.logits`)."""
        model = self.model
        head = model.embed if model.lm_head is None else model.lm_head
        native = head._native if isinstance(head, DenseLinear) else None
        if native is None or model.config.final_logit_softcap is not None:
            return None
        if model.norm.dtype != torch.bfloat16:
            return None
        return HeadWeights(model.norm, model.config.rms_norm_eps, native[1], head.out_features)

    def _use_loras(self, lora: LoraBatch) -> None:
        """Hand the step the adapter stacks, when they changed since it was last given
        them (the manager's generation): per step only their slot per row moves."""
        key = (id(lora.stacks), lora.generation)
        if key == self._lora_generation:
            return
        layers = []
        for i in range(len(self.model.decoder_layers)):
            entries: list[LoraWeights | None] = [None] * len(LORA_PROJS)
            for weight, first in (("qkv", 0), ("o_proj", 3), ("gate_up", 4), ("down", 6)):
                for j, stack in enumerate(lora.stacks.get((i, weight), ())):
                    holds = torch.zeros(stack.a.shape[0], dtype=torch.uint8)  # (L,)
                    holds[sorted(stack.used)] = 1
                    entries[first + j] = LoraWeights(stack.a, stack.b, stack.scaling, holds,
                                                     stack.segment.start)  # fmt: skip
            layers.append(entries)
        self.step.use_loras(layers)
        self._lora_generation = key


class ThreadChoice:
    """One thread or two for a native step, chosen from the steps' own times.

    Per kind of step (its row count, rounded down to a power of two, whether it has
    extends and whether it has adapter rows) it keeps the seconds of the latest `window`
    steps on each, takes the one with the smaller median, and every `explore`-th step of
    that kind the other, so a change of load (another process taking a core, or leaving
    it) is seen within a few dozen steps, and one step stalled by a preempted partner
    does not turn the choice. Where the other is far behind (its median over `far` times
    the best's: one thread at batch 1 on 2 cores: ~1.35x) it is tried 4x less
    often: each try costs a slow step. The chosen one's own slowdown is seen at once.
    Both give the same bits: the choice moves only the time."""

    def __init__(self, explore: int = 32, window: int = 8, far: float = 1.25) -> None:
        self.explore, self.window, self.far = explore, window, far
        self._seconds: dict[tuple[int, bool, bool, int], deque[float]] = {}
        self._steps: dict[tuple[int, bool, bool], int] = {}

    @staticmethod
    def _key(kind: tuple[int, bool, bool]) -> tuple[int, bool, bool]:
        rows, extends, adapters = kind
        return 1 << (max(rows, 1).bit_length() - 1), extends, adapters

    def pick(self, kind: tuple[int, bool, bool]) -> int:
        """The threads (1 or 2) for the next step of this kind."""
        key = self._key(kind)
        n = self._steps[key] = self._steps.get(key, 0) + 1
        one, two = self._seconds.get((*key, 1)), self._seconds.get((*key, 2))
        if not one or not two:
            return 1 if not one else 2
        m1, m2 = statistics.median(one), statistics.median(two)
        best, other = (1, 2) if m1 <= m2 else (2, 1)
        every = self.explore * (4 if max(m1, m2) > self.far * min(m1, m2) else 1)
        return other if n % every == 0 else best

    def record(self, kind: tuple[int, bool, bool], threads: int, seconds: float) -> None:
        """A step of this kind on `threads` took `seconds`."""
        at = (*self._key(kind), threads)
        self._seconds.setdefault(at, deque(maxlen=self.window)).append(seconds)


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
    adaptive: bool = True,
    max_rows: int = FUSED_MAX_ROWS,
) -> FusedDecode | None:
    """The native decode step for `model`, or None (logged) where it does not apply."""
    reason = why_not(model, kv_caches)
    if reason is not None:
        logger.info("decode runs the layers in torch ops: %s", reason)
        return None
    fused = FusedDecode(model, kv_caches, max_batch, threads, adaptive, max_rows)
    logger.info("decode runs the layers in one native call (batches up to %d, steps with "
                "extends up to %d tokens; buffers %.1f MB)", max_batch, max_rows,
                fused.step.buffer_bytes / 1e6)  # fmt: skip
    return fused
