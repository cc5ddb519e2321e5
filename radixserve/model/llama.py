"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV pool.

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

from collections.abc import Iterable, Sequence
from functools import partial
from typing import cast

import torch
from torch import nn

from radixserve.errors import ModelLoadError
from radixserve.kernels.ops import KernelOps
from radixserve.model.attention import AttentionBackend, AttentionMetadata
from radixserve.model.config import ModelConfig
from radixserve.model.qlinear import Linear, make_linear
from radixserve.model.quant import QuantizedRows, Scheme, Target
from radixserve.model.rope import RotaryEmbedding

Plan = dict[str, Scheme]  # model weight ("embed", "layers.3.qkv", ...) → scheme


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every value is overwritten by load_weights (checked there).
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, plan: Plan, index: int
    ) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.eps = c.rms_norm_eps
        param = partial(_param, dtype=dtype, device=device)

        def linear(name: str, out_features: int, in_features: int) -> Linear:
            scheme = plan.get(f"layers.{index}.{name}", "none")
            return make_linear(scheme, out_features, in_features, dtype, device)

        self.input_norm = param(c.hidden_size)
        self.qkv = linear("qkv", self.q_size + 2 * self.kv_size, c.hidden_size)
        self.qkv_bias = param(self.q_size + 2 * self.kv_size) if c.attention_bias else None
        self.o_proj = linear("o_proj", c.hidden_size, self.q_size)
        self.post_norm = param(c.hidden_size)
        self.gate_up = linear("gate_up", 2 * c.intermediate_size, c.hidden_size)
        self.down = linear("down", c.hidden_size, c.intermediate_size)

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next norm adds them."""
        t = x.shape[0]
        h, residual = ops.rmsnorm(x, self.input_norm, self.eps, residual)
        qkv = self.qkv(h, self.qkv_bias)  # (T, q_size + 2 kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, H_kv, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        ops.rope(q, k, positions, rope.cos, rope.sin)  # in place
        o = attn.forward(q, k, v, caches[0], caches[1], meta)  # (T, H, D)
        h, residual = ops.rmsnorm(
            self.o_proj(o.reshape(t, self.q_size)), self.post_norm, self.eps, residual
        )
        up = ops.silu_and_mul(self.gate_up(h))  # (T, I)
        return self.down(up), residual


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
    ) -> None:
        super().__init__()
        self.config = config
        plan = plan or {}
        param = partial(_param, dtype=dtype, device=device)
        v, h = config.vocab_size, config.hidden_size
        self.embed = make_linear(plan.get("embed", "none"), v, h, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device, plan, i) for i in range(config.num_layers)
        )
        self.norm = param(config.hidden_size)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else make_linear(plan.get("lm_head", "none"), v, h, dtype, device)
        )
        self.rope = RotaryEmbedding(config, max_positions, device)
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
    ) -> torch.Tensor:
        x = self.embed.rows(input_ids)  # (T, hidden)
        residual = None
        for i, layer in enumerate(self.decoder_layers):
            x, residual = layer(
                x, residual, positions, self.ops, self.rope, self.attention, kv_caches[i], meta
            )
        assert residual is not None
        # The LM head is the costliest matmul for a small model: apply it only where needed.
        x, _ = self.ops.rmsnorm(
            x.index_select(0, logits_indices),
            self.norm,
            self.config.rms_norm_eps,
            residual.index_select(0, logits_indices),
        )
        head = self.embed if self.lm_head is None else self.lm_head
        return head(x).float()  # (N, vocab)

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
            dest, start, shape = targets[name]
            if tuple(weight.shape) != shape:
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(weight.shape)}, expected {shape}"
                )
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

    def _weight_targets(self) -> dict[str, tuple[Linear | torch.Tensor, int, tuple[int, ...]]]:
        """Checkpoint name → (layer or parameter, first row, the piece's shape)."""
        return {
            name: (self._dest(key), start, shape)
            for key, pieces in weight_layout(self.config).items()
            for name, start, shape in pieces
        }

    def _dest(self, key: str) -> Linear | torch.Tensor:
        obj: object = self
        for part in key.split("."):
            obj = obj[int(part)] if part.isdigit() else getattr(obj, part)  # type: ignore[index]
        assert isinstance(obj, (Linear, torch.Tensor)), key
        return obj


def weight_layout(c: ModelConfig) -> dict[str, list[tuple[str, int, tuple[int, ...]]]]:
    """Model weight ("layers.3.qkv") → its checkpoint pieces (name, first row, shape)."""
    h, q = c.hidden_size, c.num_heads * c.head_dim
    kv, ff = c.num_kv_heads * c.head_dim, c.intermediate_size
    out: dict[str, list[tuple[str, int, tuple[int, ...]]]] = {
        "embed": [("model.embed_tokens.weight", 0, (c.vocab_size, h))],
        "norm": [("model.norm.weight", 0, (h,))],
    }
    if not c.tie_word_embeddings:
        out["lm_head"] = [("lm_head.weight", 0, (c.vocab_size, h))]
    for i in range(c.num_layers):
        p, key = f"model.layers.{i}.", f"layers.{i}."
        attn = [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)]
        out[key + "qkv"] = [(f"{p}self_attn.{n}_proj.weight", s, (r, h)) for n, s, r in attn]
        if c.attention_bias:
            out[key + "qkv_bias"] = [(f"{p}self_attn.{n}_proj.bias", s, (r,)) for n, s, r in attn]
        out[key + "o_proj"] = [(f"{p}self_attn.o_proj.weight", 0, (h, q))]
        out[key + "gate_up"] = [
            (f"{p}mlp.gate_proj.weight", 0, (ff, h)),
            (f"{p}mlp.up_proj.weight", ff, (ff, h)),
        ]
        out[key + "down"] = [(f"{p}mlp.down_proj.weight", 0, (h, ff))]
        out[key + "input_norm"] = [(f"{p}input_layernorm.weight", 0, (h,))]
        out[key + "post_norm"] = [(f"{p}post_attention_layernorm.weight", 0, (h,))]
    return out


def quant_targets(c: ModelConfig) -> dict[str, Target]:
    """The matrices `plan_schemes` chooses a scheme for (norms and biases stay float)."""
    return {
        key: Target(
            tuple((name, shape[0]) for name, _, shape in pieces),
            pieces[0][2][1],
            embedding=key == "embed",
        )
        for key, pieces in weight_layout(c).items()
        if len(pieces[0][2]) == 2
    }


def checkpoint_schemes(c: ModelConfig, plan: Plan) -> dict[str, Scheme]:
    """Checkpoint tensor name → the scheme its model weight is stored in."""
    return {
        name: plan.get(key, "none")
        for key, pieces in weight_layout(c).items()
        for name, _, _ in pieces
        if len(pieces[0][2]) == 2
    }
