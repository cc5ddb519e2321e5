"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, the
mixture-of-experts Qwen3-MoE and Mixtral: `radixserve.model.moe`, and Gemma 3) over a
paged KV pool.

Gemma 3 is this decoder with its options on (`ModelConfig`): a sliding window on five of
six layers (their RoPE of another base), norms after the attention and after the MLP as
well as before them, a GELU (tanh) gated MLP, embeddings scaled by sqrt(hidden), and a
softmax scale of its own. Its norms multiply by (1 + w) in the checkpoint's terms; the
loaders give the model 1 + w (GGUF files store it so already), so every norm here is
the same op. The KV pool stores every position of every layer, sliding ones included:
the window is applied by the attention kernels, which skip what lies before it, so the
pages, the radix cache and the transfers are the same as for any model (a cached prefix
longer than the window is simply read from the window on) at the memory cost of the
positions a sliding layer no longer reads.

Projections are fused at load time — q/k/v into one `qkv` matrix and gate/up into one
`gate_up` — because on CPU (and GPU) one large GEMM beats three small ones. Each matrix
is a `radixserve.model.qlinear` layer in the scheme `plan` gives it (dense, int8, int4,
fp8); with no plan all are dense in the compute dtype. Tokens of
all sequences in a step are flattened into one (T, hidden) batch; only attention needs
to know where one sequence ends (see `radixserve.model.attention`). The hot ops (norms
with the residual add fused in, rope, silu * up, attention) come from one kernel set
(`radixserve.kernels`), chosen once per engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.errors import ModelLoadError
from radixserve.kernels.ops import KernelOps
from radixserve.model.attention import AttentionBackend, AttentionMetadata
from radixserve.model.config import ModelConfig
from radixserve.model.layout import Plan, shard_layout, weight_layout
from radixserve.model.moe import MoE
from radixserve.model.qlinear import DenseLinear, Linear, make_linear
from radixserve.model.quant import QuantizedRows, quantize
from radixserve.model.rope import RotaryEmbedding
from radixserve.model.tp import Take, TPComm, TPShard, take

if TYPE_CHECKING:
    from radixserve.model.lora_manager import LoraBatch

logger = logging.getLogger(__name__)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every value is overwritten by load_weights (checked there).
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        plan: Plan,
        index: int,
        tp: TPShard,
        comm: TPComm | None,
    ) -> None:
        super().__init__()
        c = config
        # this rank's heads and MLP rows (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads, self.head_dim = tp.q_heads(c), tp.kv_heads(c), c.head_dim
        self.q_size = self.num_heads * c.head_dim
        self.kv_size = self.num_kv_heads * c.head_dim
        self.eps = c.rms_norm_eps
        self.window = c.sliding_window if index in c.sliding_layers else 0
        self.scale = c.attention_scale
        self.gelu = c.hidden_act == "gelu_tanh"
        self.index = index  # its adapters' stacks are found by it (`LoraBatch.add`)
        self.comm = comm  # sums the row-parallel o and down outputs over the ranks
        param = partial(_param, dtype=dtype, device=device)

        def linear(name: str, out_features: int, in_features: int) -> Linear:
            scheme = plan.get(f"layers.{index}.{name}", "none")
            return make_linear(scheme, out_features, in_features, dtype, device)

        self.input_norm = param(c.hidden_size)
        self.qkv = linear("qkv", self.q_size + 2 * self.kv_size, c.hidden_size)
        self.qkv_bias = param(self.q_size + 2 * self.kv_size) if c.attention_bias else None
        self.q_norm = param(c.head_dim) if c.qk_norm else None  # per head, before RoPE
        self.k_norm = param(c.head_dim) if c.qk_norm else None
        self.o_proj = linear("o_proj", c.hidden_size, self.q_size)
        self.post_norm = param(c.hidden_size)  # before the MLP
        self.attn_out_norm = param(c.hidden_size) if c.post_norms else None
        self.mlp_out_norm = param(c.hidden_size) if c.post_norms else None
        self.moe: MoE | None = None
        if index in c.moe_layers:  # the experts instead of the dense MLP
            schemes = [
                (plan.get(f"layers.{index}.moe.gate_up.{e}", "none"),
                 plan.get(f"layers.{index}.moe.down.{e}", "none"))
                for e in range(c.num_experts)
            ]  # fmt: skip
            self.moe = MoE(c, tp.moe_ff(c), schemes, dtype, device)
        else:
            self.gate_up = linear("gate_up", 2 * tp.ff(c), c.hidden_size)
            self.down = linear("down", c.hidden_size, tp.ff(c))

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden): the previous layer's output (the embeddings first)
        residual: torch.Tensor | None,  # (T, hidden): the stream x adds to (None first)
        positions: torch.Tensor,
        ops: KernelOps,
        rope: RotaryEmbedding,
        attn: AttentionBackend,
        caches: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next norm adds them.
        With ``lora``, each projection's output gets its rows' adapter updates."""
        t = x.shape[0]
        h, residual = ops.rmsnorm(x, self.input_norm, self.eps, residual)
        qkv = self.qkv(h, self.qkv_bias)  # (T, q_size + 2 kv_size)
        if lora is not None:
            lora.add(ops, self.index, "qkv", h, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, H_kv, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = ops.rmsnorm(q.reshape(-1, self.head_dim), self.q_norm, self.eps)[0].view_as(q)
            k = ops.rmsnorm(k.reshape(-1, self.head_dim), self.k_norm, self.eps)[0].view_as(k)
        ops.rope(q, k, positions, rope.cos, rope.sin)  # in place
        o = attn.forward(
            q, k, v, caches[0], caches[1], meta, window=self.window, scale=self.scale
        )  # (T, H, D)
        o = o.reshape(t, self.q_size)  # (T, q_size)
        attn_out = self.o_proj(o)
        if lora is not None:
            lora.add(ops, self.index, "o_proj", o, attn_out)
        if self.comm is not None:
            self.comm.all_reduce(attn_out)
        if self.attn_out_norm is not None:
            attn_out = ops.rmsnorm(attn_out, self.attn_out_norm, self.eps)[0]
        h, residual = ops.rmsnorm(attn_out, self.post_norm, self.eps, residual)
        out = self.moe(h, ops) if self.moe is not None else self._mlp(h, ops, lora)
        if self.comm is not None:
            self.comm.all_reduce(out)
        if self.mlp_out_norm is not None:
            out = ops.rmsnorm(out, self.mlp_out_norm, self.eps)[0]
        return out, residual

    def _mlp(self, h: torch.Tensor, ops: KernelOps, lora: LoraBatch | None) -> torch.Tensor:
        """The dense MLP of h (T, hidden), via (T, I), with the rows' adapter updates."""
        if lora is None:
            return self.down(self._act(self.gate_up(h), ops))
        gate_up = self.gate_up(h)  # (T, 2 I)
        lora.add(ops, self.index, "gate_up", h, gate_up)
        act = self._act(gate_up, ops)  # (T, I)
        out = self.down(act)
        lora.add(ops, self.index, "down", act, out)
        return out

    def _act(self, gate_up: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """act(gate) * up of a (T, 2 I) gate/up output."""
        if not self.gelu:
            return ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class LlamaModel(nn.Module):
    """Embeddings → decoder layers → final norm → LM head (tied or not)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        attention: AttentionBackend,
        ops: KernelOps,
        plan: Plan | None = None,
        tp: TPShard | None = None,
        comm: TPComm | None = None,
    ) -> None:
        """``tp``: the rank of a tensor-parallel group this model is the shard of (None:
        the whole model), and ``comm`` its collectives (needed when the group has more
        than one rank)."""
        super().__init__()
        self.config = config
        self.tp = tp = tp or TPShard()
        assert (comm is not None) == (tp.size > 1), "a shard needs its group's collectives"
        self.comm = comm
        tp.check(config)
        plan = plan or {}
        param = partial(_param, dtype=dtype, device=device)
        v, h = tp.vocab_rows(config), config.hidden_size  # this rank's vocabulary rows
        self.embed = make_linear(plan.get("embed", "none"), v, h, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device, plan, i, tp, comm) for i in range(config.num_layers)
        )
        self.norm = param(config.hidden_size)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else make_linear(plan.get("lm_head", "none"), v, h, dtype, device)
        )
        self.rope = RotaryEmbedding(config, max_positions, device)
        self.rope_local = None  # the sliding layers' own RoPE (Gemma), if they have one
        if config.rope_local_theta is not None:
            local = dataclasses.replace(
                config, rope_theta=config.rope_local_theta, rope_scaling=None
            )
            self.rope_local = RotaryEmbedding(local, max_positions, device)
        self.attention = attention
        self.ops = ops

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer: K, V pages
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # (N,) rows of T whose next-token logits are wanted
        lora: LoraBatch | None = None,  # the rows' LoRA adapters (None: the base model)
    ) -> torch.Tensor:
        x = self._embed(input_ids)  # (T, hidden)
        residual = None
        for i, layer in enumerate(self.decoder_layers):
            rope = self.rope_local if layer.window and self.rope_local else self.rope
            x, residual = layer(
                x, residual, positions, self.ops, rope, self.attention, kv_caches[i], meta, lora
            )
        assert residual is not None
        return self.logits(x, residual, logits_indices)

    def logits(
        self,
        x: torch.Tensor,  # (T, hidden): the last layer's output
        residual: torch.Tensor,  # (T, hidden): the residual stream before it
        logits_indices: torch.Tensor,  # (N,)
    ) -> torch.Tensor:
        """The final norm and the LM head on rows `logits_indices`: (N, vocab) float32."""
        # The LM head is the costliest matmul for a small model: apply it only where needed.
        x, _ = self.ops.rmsnorm(
            x.index_select(0, logits_indices),
            self.norm,
            self.config.rms_norm_eps,
            residual.index_select(0, logits_indices),
        )
        head = self.embed if self.lm_head is None else self.lm_head
        logits = head(x)  # (N, this rank's vocabulary rows)
        if self.comm is not None:  # every rank's slice, then the padding rows cut off
            logits = self.comm.all_gather(logits)[:, : self.config.vocab_size]
        if (cap := self.config.final_logit_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()  # (N, vocab)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self._lookup(input_ids)
        if self.config.embed_scale:  # as the float32 scalar, rounded to the dtype
            x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)
        return x

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return self.embed.rows(input_ids)
        # vocab-parallel: this rank's rows for its tokens, zeros for the others; summed
        lo, hi = self.tp.vocab_range(self.config)
        local = input_ids - lo
        mine = (local >= 0) & (local < hi - lo)
        x = self.embed.rows(torch.where(mine, local, 0))
        x = x * mine.unsqueeze(-1).to(x.dtype)
        self.comm.all_reduce(x)
        return x

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take (quantized where they are)."""
        return sum(t.nbytes for t in (*self.parameters(), *self.buffers()))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedRows]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; every one is required."""
        targets = self._weight_targets()
        missing = set(targets)
        for name, weight in weights:
            if name not in targets:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ModelLoadError(f"unexpected weight {name!r} for {self.config.architecture}")
            dest, start, shape, how = targets[name]
            if tuple(weight.shape) != shape:
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(weight.shape)}, expected {shape}"
                )
            weight = take(weight, how, name)  # this rank's slice
            shape = tuple(weight.shape)
            if isinstance(dest, Linear):
                dest.load(start, weight)
            else:
                assert isinstance(weight, torch.Tensor), name  # norms and biases stay float
                dest[start : start + shape[0]].copy_(weight)
            missing.discard(name)
        if missing:
            raise ModelLoadError(
                f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}"
            )
        self._zero_vocab_padding()
        head = self.embed if self.lm_head is None else self.lm_head
        if isinstance(head, DenseLinear) and (extra := head.pack_native()):
            logger.info("the LM head runs the native GEMM (its weight packed: %.0f MiB)",
                        extra / (1 << 20))  # fmt: skip

    def _zero_vocab_padding(self) -> None:
        """The rows past the vocabulary that the last rank's slices hold: zeros (their
        logits are cut off, and no token looks them up)."""
        lo, hi = self.tp.vocab_range(self.config)
        pad = self.tp.vocab_rows(self.config) - (hi - lo)
        for layer in (self.embed, self.lm_head):
            if pad and layer is not None:
                zeros = torch.zeros(pad, self.config.hidden_size)
                layer.load(
                    hi - lo, zeros if layer.scheme == "none" else quantize(zeros, layer.scheme)
                )

    def _weight_targets(
        self,
    ) -> dict[str, tuple[Linear | torch.Tensor, int, tuple[int, ...], Take | None]]:
        """Checkpoint name → (layer or parameter, first row there, the checkpoint's shape,
        the slice of it this rank keeps)."""
        full = {name: shape for pieces in weight_layout(self.config).values()
                for name, _, shape in pieces}  # fmt: skip
        return {
            name: (self._dest(key), start, full[name], how)
            for key, pieces in shard_layout(self.config, self.tp).items()
            for name, start, _, how in pieces
        }

    def _dest(self, key: str) -> Linear | torch.Tensor:
        obj: object = self
        for part in key.split("."):
            obj = obj[int(part)] if part.isdigit() else getattr(obj, part)  # type: ignore[index]
        assert isinstance(obj, (Linear, torch.Tensor)), key
        return obj
