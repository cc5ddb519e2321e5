"""A whole decode step of a Llama-family decoder in one native call (`decode.c`).

The layers' ops written in torch cost a dispatch and an allocation each (a dozen per
layer, most of a decode step's time on a small model); `DecodeStep` runs every layer of
a step of new tokens (rows) in one call over buffers allocated once, and returns what
the torch layers return, (x, residual) before the final norm, bit for bit: the GEMMs and
the attention are the same C functions in the same order, and the norms, RoPE and
silu · up round as the torch ops do (`decode.c` writes out each step). It takes
bfloat16 activations and int4 or int8 weights in the native GEMM's layouts
(`qgemm.py`), and bfloat16 KV pools (`attention.py`).

A row is one new token: its position, its KV slot and its sequence's page-table row.
Several rows may be one sequence's consecutive positions (a cached turn's delta): each
layer stores every row's K/V before any row attends, so a row sees the rows before it.

With LoRA stacks (`use_loras`) and each row's slot, every projection's output gets the
rows' adapter updates inside the call (`lora.c`'s functions, the bits of `lora_apply`
after the torch layers' projection), over scratch made with the stacks, not per step.

With n threads the call is handed to the native kernels' pool once per step; the
threads split each GEMM's column blocks and the attention's (row, KV head) items and
meet at barriers inside the call (`threads.py`: a split never changes a bit).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.kernels.cpu.native import native_library
from radixserve.kernels.cpu.threads import run_strided

_P, _I, _F, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double
MAX_HIDDEN = 16384  # decode.c's row buffers
GROUP_MIN = 16  # the int4 group sums' buffer assumes groups of at least this many inputs
LANES = 16  # lora.c's partial sums per dot product: its rows of t are padded to them


class _Proj(ctypes.Structure):
    _fields_ = [("w", _P), ("scales", _P), ("n", _I), ("k", _I), ("group", _I),
                ("is_int8", _I)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Proj), ("o", _Proj),
                ("gate_up", _Proj), ("down", _Proj), ("k_cache", _P), ("v_cache", _P)]  # fmt: skip


class _LoraProj(ctypes.Structure):
    _fields_ = [("a", _P), ("b", _P), ("scaling", _P), ("holds", _P), ("b_ls", _I),
                ("b_lm", _I), ("b_lr", _I), ("start", _I), ("width", _I)]  # fmt: skip


class _Barrier(ctypes.Structure):
    _fields_ = [("arrived", ctypes.c_int), ("generation", ctypes.c_int)]


class _Step(ctypes.Structure):
    _fields_ = [
        ("num_layers", _I), ("batch", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I),
        ("head_dim", _I), ("inter", _I), ("sum_lanes", _I), ("eps", _F), ("scale", _D),
        ("page_size", _I), ("table_stride", _I), ("layers", _P), ("cos", _P), ("sin", _P),
        ("silu", _P), ("positions", _P), ("slots", _P), ("page_table", _P), ("row_seq", _P),
        ("row_pos", _P), ("chunks", _P), ("x", _P), ("residual", _P * 2), ("qkv", _P),
        ("attn", _P), ("proj", _P), ("gate_up", _P), ("act", _P), ("h", _P), ("xs", _P),
        ("xs_stride", _I), ("barrier", _P), ("num_chunks", _I), ("row_slot", _P), ("lora", _P),
        ("lora_rank", _I), ("lora_slots", _I), ("lora_t", _P), ("lora_xf", _P), ("lora_bt", _P),
        ("lora_made", _P), ("lora_t_stride", _I), ("lora_xf_stride", _I),
        ("lora_bt_stride", _I), ("final_norm", _P), ("head_w", _P), ("vocab", _I),
        ("head_eps", _F), ("head_rows", _P), ("head_count", _I), ("head_y", _P),
        ("logits", _P),
    ]  # fmt: skip


@dataclass(frozen=True)
class RowRuns:
    """Which sequence each row of a step is, for the attention: row_seq (B,) int64, each
    row's row of the page table; chunks (C + 1,) int64, runs of rows [chunks[i],
    chunks[i + 1]) of one sequence, attended together (each K/V block read once a run;
    the same bits as one run a row)."""

    row_seq: torch.Tensor
    chunks: torch.Tensor


@dataclass(frozen=True)
class ProjWeights:
    """One projection in the native GEMM's layout: int4 (packed (N/16, K/8, 64) uint8,
    scales and zeros (K/group, N, 2) bfloat16) or int8 (packed (N/16, K/2, 32) int8,
    scales (N,) bfloat16)."""

    packed: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    group: int  # int4's group; 0 for int8

    @property
    def is_int8(self) -> bool:
        return self.group == 0


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,) bfloat16
    post_norm: torch.Tensor
    qkv: ProjWeights  # (q_size + 2 kv_size, hidden)
    o: ProjWeights  # (hidden, q_size)
    gate_up: ProjWeights  # (2 inter, hidden): gate rows, then up rows
    down: ProjWeights  # (hidden, inter)
    k_cache: torch.Tensor  # (P, page_size, kv_heads, head_dim) bfloat16, contiguous
    v_cache: torch.Tensor


#: a layer's adapted projections, in the order of `DecodeStep.use_loras`' entries
LORA_PROJS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class LoraWeights:
    """One adapted projection's LoRA stack as the native step reads it (`lora.c`'s
    layouts, `lora_apply`'s arguments). Its update goes to the columns [start, start +
    width) of the fused output (qkv's q, k, v; gate_up's gate, up) as
    `radixserve.model.lora_manager.LoraBatch.add` adds it: not at all in a step where no
    row's slot ``holds`` an adapter of it, else to every adapter row (a slot whose adapter
    does not adapt it holds zeros)."""

    a: torch.Tensor  # (L, R, K) contiguous
    b: torch.Tensor  # (L, width, R), a unit stride in width (fast) or in R
    scaling: torch.Tensor  # (L,) float32 contiguous
    holds: torch.Tensor  # (L,) uint8: slot s's adapter adapts this projection
    start: int  # its first column of the fused output


@dataclass(frozen=True)
class HeadWeights:
    """The final norm and a bfloat16 LM head in `qgemm.pack_bf16`'s layout: a step given
    them ends with the logits of the rows it is asked for (`LlamaModel.logits`' bits)."""

    norm: torch.Tensor  # (hidden,) bfloat16
    eps: float
    packed: torch.Tensor  # (vocab / 16, hidden / 2, 32) bfloat16
    vocab: int


@dataclass(frozen=True)
class DecodeShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    scale: float  # the attention's softmax scale
    page_size: int


@functools.cache
def sum_lanes(hidden: int) -> int | None:
    """The float lanes of torch's CPU sum kernel here (its Vectorized<float>: 8 on torch
    2.13's x86 builds, AVX-512 machines included), found by summing probe rows of
    `hidden` squares both ways; None where neither 8 nor 16 gives torch's bits."""
    lib = native_library()
    if lib is None:
        return None
    lib.decode_sum.restype = _F
    lib.decode_sum.argtypes = [_P, _I, _I]
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, hidden, generator=gen) * torch.rand(64, 1, generator=gen) * 8
    squares = rows.to(torch.bfloat16).float().pow(2)  # (64, hidden): what the norm sums
    expected = squares.sum(-1).tolist()
    for lanes in (8, 16):
        got = [lib.decode_sum(row.data_ptr(), hidden, lanes) for row in squares]
        if got == expected:
            return lanes
    return None


@functools.cache
def silu_table() -> torch.Tensor:
    """(65536,) bfloat16: torch's silu of every bfloat16 value, by its bits (computed by
    torch's own kernel, whole vectors, as it computes a gate row of a multiple of 64)."""
    bits = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16))
    return F.silu(bits.view(torch.bfloat16)).contiguous()


def supports(shape: DecodeShape) -> str | None:
    """Why this step shape cannot run natively (None: it can)."""
    if native_library() is None:
        return "the native CPU kernels are not built"
    if shape.hidden > MAX_HIDDEN or shape.hidden % 16:
        return f"hidden size {shape.hidden} (a multiple of 16 up to {MAX_HIDDEN})"
    if shape.head_dim % 16 or shape.head_dim > 256 or shape.heads % shape.kv_heads:
        return f"head dim {shape.head_dim} / heads {shape.heads} of {shape.kv_heads}"
    if shape.inter % 64:  # torch's silu runs whole vector pairs (64) on such rows only
        return f"intermediate size {shape.inter} (a multiple of 64)"
    if sum_lanes(shape.hidden) is None:
        return "torch's float sum adds in an order decode.c does not reproduce"
    return None


class DecodeStep:
    """Every layer of a step in one native call; buffers for up to `max_rows` rows
    (new tokens) made once (`buffer_bytes`)."""

    def __init__(
        self,
        shape: DecodeShape,
        layers: list[LayerWeights],
        cos: torch.Tensor,  # (max_pos, head_dim / 2) float32
        sin: torch.Tensor,
        max_rows: int,
        threads: int,
    ) -> None:
        lib = native_library()
        assert lib is not None and supports(shape) is None
        lib.decode_step.restype = None
        lib.decode_step.argtypes = [_P, _I, _I]
        lib.decode_step_size.restype = _I
        assert lib.decode_step_size() == ctypes.sizeof(_Step), "decode.c and decode.py differ"
        self._lib, self.shape, self.max_rows, self.threads = lib, shape, max_rows, threads
        s, b = shape, max_rows
        self._lora_keep: list[object] = []  # the LoRA table and scratch (`use_loras`)
        self._keep = [cos.contiguous(), sin.contiguous(), silu_table()]
        self._layers = (_Layer * len(layers))(*[self._layer(w) for w in layers])
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        max_k = max(s.hidden, q_size, s.inter)

        self.buffer_bytes = 0  # the activation buffers below

        def buf(*size: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
            t = torch.zeros(*size, dtype=dtype)
            self._keep.append(t)
            self.buffer_bytes += t.nbytes
            return t

        self.residual = buf(2, b, s.hidden)  # (2, B, hidden): the stream ends in [0]
        # a decode step's rows: row b is sequence b, a run of its own
        self._one_each = RowRuns(torch.arange(b, dtype=torch.int64),
                                 torch.arange(b + 1, dtype=torch.int64))  # fmt: skip
        self._barrier = _Barrier(0, 0)
        step = _Step(
            num_layers=len(layers), hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads,
            head_dim=s.head_dim, inter=s.inter, sum_lanes=sum_lanes(s.hidden), eps=s.eps,
            scale=s.scale, page_size=s.page_size, layers=ctypes.addressof(self._layers),
            cos=self._keep[0].data_ptr(), sin=self._keep[1].data_ptr(),
            silu=self._keep[2].data_ptr(),
            qkv=buf(b, q_size + 2 * kv_size).data_ptr(), attn=buf(b, q_size).data_ptr(),
            proj=buf(b, s.hidden).data_ptr(), gate_up=buf(b, 2 * s.inter).data_ptr(),
            act=buf(b, s.inter).data_ptr(), h=buf(threads, b, s.hidden).data_ptr(),
            xs=buf(threads, b, max_k // GROUP_MIN, dtype=torch.float32).data_ptr(),
            xs_stride=max_k // GROUP_MIN, barrier=ctypes.addressof(self._barrier),
        )  # fmt: skip
        step.residual[0] = self.residual[0].data_ptr()
        step.residual[1] = self.residual[1].data_ptr()
        self._step = step
        self._max_k = max_k

    def use_loras(self, layers: Sequence[Sequence[LoraWeights | None]]) -> None:
        """The LoRA stacks later calls with ``lora_slots`` add: per layer, the entries of
        `LORA_PROJS` (None: not adapted), every stack of one depth L and rank R. Makes
        the scratch of the updates for them (call again when a stack is made, moved or
        its slots change; not per step)."""
        assert len(layers) == self._step.num_layers
        assert all(len(layer) == len(LORA_PROJS) for layer in layers)
        stacks = [w for layer in layers for w in layer if w is not None]
        num_slots, rank = stacks[0].a.shape[:2] if stacks else (1, 1)
        assert all(w.a.shape[:2] == (num_slots, rank) for w in stacks), "one L and R"
        assert all(w.a.dtype == w.b.dtype == torch.bfloat16 and w.a.is_contiguous()
                   and 1 in w.b.stride()[1:] and w.holds.shape == (num_slots,)
                   and w.holds.dtype == torch.uint8 for w in stacks)  # fmt: skip
        rp, b, n = -(-rank // LANES) * LANES, self.max_rows, self.threads
        table = (_LoraProj * (len(layers) * len(LORA_PROJS)))()
        for i, w in enumerate(e for layer in layers for e in layer):
            if w is not None:
                table[i] = _LoraProj(w.a.data_ptr(), w.b.data_ptr(), w.scaling.data_ptr(),
                                     w.holds.data_ptr(), *w.b.stride(), w.start,
                                     w.b.shape[1])  # fmt: skip
        t = torch.zeros(n, b, rp)  # (threads, B, R up to 16): each row's a @ x
        xf = torch.zeros(n, 4, -(-self._max_k // LANES) * LANES)  # (threads, 4, K up to 16)
        bt = torch.zeros(n * num_slots * rp * LANES + LANES)  # (threads, L, R up to 16, 16)
        skip = (-bt.data_ptr() % 64) // 4  # 64-byte aligned: lora.c's vectors
        made = torch.zeros(n, num_slots, dtype=torch.int64)  # (threads, L)
        st = self._step
        st.lora, st.lora_rank, st.lora_slots = ctypes.addressof(table), rank, num_slots
        st.lora_t, st.lora_xf, st.lora_made = t.data_ptr(), xf.data_ptr(), made.data_ptr()
        st.lora_bt = bt.data_ptr() + 4 * skip
        st.lora_t_stride, st.lora_xf_stride = b * rp, xf[0].numel()
        st.lora_bt_stride = num_slots * rp * LANES
        self._lora_keep = [table, t, xf, bt, made, layers]

    @staticmethod
    def _layer(w: LayerWeights) -> _Layer:
        def proj(p: ProjWeights) -> _Proj:
            return _Proj(p.packed.data_ptr(), p.scales.data_ptr(), p.out_features,
                         p.in_features, p.group, int(p.is_int8))  # fmt: skip

        return _Layer(w.input_norm.data_ptr(), w.post_norm.data_ptr(), proj(w.qkv), proj(w.o),
                      proj(w.gate_up), proj(w.down), w.k_cache.data_ptr(),
                      w.v_cache.data_ptr())  # fmt: skip

    def __call__(
        self,
        x: torch.Tensor,  # (B, hidden) bfloat16 contiguous: the embeddings; overwritten
        positions: torch.Tensor,  # (B,) int64: each new token's position
        slots: torch.Tensor,  # (B,) int64: its KV slot (-1: none)
        page_table: torch.Tensor,  # (S, W) int64 contiguous: each sequence's pages
        threads: int | None = None,  # at most the threads it was built for (default)
        rows: RowRuns | None = None,  # None: row b is sequence b (S = B), one token each
        lora_slots: torch.Tensor | None = None,  # (B,) int64: each row's LoRA slot (-1: none)
        head: HeadWeights | None = None,
        head_rows: torch.Tensor | None = None,  # (N,) int64 contiguous, with ``head``
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(the last layer's output, the residual stream before it, both (B, hidden);
        the logits of ``head_rows`` (N, vocab) float32 where ``head`` is given, else
        None); x is the first (written in place), the second a view of a buffer the next
        call overwrites, the logits a new tensor. A row attends to its sequence's keys up
        to its own position (the rows before it in this step included). With
        ``lora_slots``, each projection's output gets each row's update from the stacks of
        `use_loras`, as the torch layers' ``lora_apply`` adds it. The same bits on any
        number of threads."""
        batch = x.shape[0]
        assert 0 < batch <= self.max_rows and x.dtype == torch.bfloat16 and x.is_contiguous()
        assert page_table.is_contiguous() and positions.is_contiguous() and slots.is_contiguous()
        runs = self._one_each if rows is None else rows
        if rows is None:
            assert page_table.shape[0] == batch
        else:
            assert rows.row_seq.shape[0] == batch and int(rows.chunks[-1]) == batch
        st = self._step
        st.batch, st.x = batch, x.data_ptr()
        st.positions = st.row_pos = positions.data_ptr()  # a row's keys end at its position
        st.slots, st.page_table = slots.data_ptr(), page_table.data_ptr()
        st.row_seq, st.chunks = runs.row_seq.data_ptr(), runs.chunks.data_ptr()
        st.num_chunks = batch if rows is None else rows.chunks.shape[0] - 1
        st.table_stride = page_table.shape[1]
        st.row_slot = None
        if lora_slots is not None:
            assert self._lora_keep, "use_loras first"
            assert lora_slots.shape == (batch,) and lora_slots.dtype == torch.int64
            assert lora_slots.is_contiguous() and int(lora_slots.max()) < st.lora_slots
            st.row_slot = lora_slots.data_ptr()
        logits = self._head(head, head_rows, batch)
        self._barrier.arrived = self._barrier.generation = 0
        ptr = ctypes.addressof(st)
        threads = min(threads or self.threads, self.threads, torch.get_num_threads())
        run_strided(lambda t, n: self._lib.decode_step(ptr, t, n), threads, threads > 1)
        return x, self.residual[0, :batch], logits

    def _head(
        self, head: HeadWeights | None, rows: torch.Tensor | None, batch: int
    ) -> torch.Tensor | None:
        """Point the step at ``head`` for ``rows`` (none: no head); the logits it fills."""
        st = self._step
        st.head_w = None
        if head is None:
            return None
        assert rows is not None and rows.dtype == torch.int64 and rows.is_contiguous()
        count = rows.shape[0]
        assert count <= batch and head.packed.shape[1] * 2 == self.shape.hidden
        logits = torch.empty(count, head.vocab, dtype=torch.float32)
        if count == 0:  # a chunk that ends no prompt: no row wants logits
            return logits
        scratch = torch.empty(count, head.vocab, dtype=torch.bfloat16)
        self._head_keep = (head, rows, scratch)  # alive until the next call
        st.final_norm, st.head_w = head.norm.data_ptr(), head.packed.data_ptr()
        st.vocab, st.head_eps = head.vocab, head.eps
        st.head_rows, st.head_count = rows.data_ptr(), count
        st.head_y, st.logits = scratch.data_ptr(), logits.data_ptr()
        return logits
