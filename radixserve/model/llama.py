"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV pool.

Projections are fused at load time — q/k/v into one `qkv` matrix and gate/up into one
`gate_up` — because on CPU (and GPU) one large GEMM beats three small ones. Tokens of
all sequences in a step are flattened into one (T, hidden) batch; only attention needs
to know where one sequence ends (see `radixserve.model.attention`). The hot ops (norms
with the residual add fused in, rope, silu * up, attention) come from one kernel set
(`radixserve.kernels`), chosen once per engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.cache.kv_pool import KVPool
from radixserve.errors import ModelLoadError
from radixserve.kernels.ops import KernelOps
from radixserve.model.attention import AttentionBackend, AttentionMetadata
from radixserve.model.config import ModelConfig
from radixserve.model.rope import RotaryEmbedding


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every value is overwritten by load_weights (checked there).
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.eps = c.rms_norm_eps
        param = partial(_param, dtype=dtype, device=device)
        self.input_norm = param(c.hidden_size)
        self.qkv = param(self.q_size + 2 * self.kv_size, c.hidden_size)
        self.qkv_bias = param(self.q_size + 2 * self.kv_size) if c.attention_bias else None
        self.o_proj = param(c.hidden_size, self.q_size)
        self.post_norm = param(c.hidden_size)
        self.gate_up = param(2 * c.intermediate_size, c.hidden_size)
        self.down = param(c.hidden_size, c.intermediate_size)

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
        qkv = F.linear(h, self.qkv, self.qkv_bias)  # (T, q_size + 2 kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, H_kv, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        ops.rope(q, k, positions, rope.cos, rope.sin)  # in place
        o = attn.forward(q, k, v, caches[0], caches[1], meta)  # (T, H, D)
        h, residual = ops.rmsnorm(
            F.linear(o.reshape(t, self.q_size), self.o_proj), self.post_norm, self.eps, residual
        )
        up = ops.silu_and_mul(F.linear(h, self.gate_up))  # (T, I)
        return F.linear(up, self.down), residual


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
    ) -> None:
        super().__init__()
        self.config = config
        param = partial(_param, dtype=dtype, device=device)
        self.embed = param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = param(config.hidden_size)
        self.lm_head = (
            None if config.tie_word_embeddings else param(config.vocab_size, config.hidden_size)
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
        kv_pool: KVPool,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # (N,) rows of T whose next-token logits are wanted
    ) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)  # (T, hidden)
        residual = None
        for i, layer in enumerate(self.decoder_layers):
            x, residual = layer(
                x, residual, positions, self.ops, self.rope, self.attention, kv_pool.layer(i), meta
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
        return F.linear(x, head).float()  # (N, vocab)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; every one is required."""
        targets = self._weight_targets()
        missing = set(targets)
        for name, tensor in weights:
            if name not in targets:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ModelLoadError(f"unexpected weight {name!r} for {self.config.architecture}")
            param, rows = targets[name]
            dest = param if rows is None else param[rows[0] : rows[1]]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            missing.discard(name)
        if missing:
            raise ModelLoadError(
                f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}"
            )

    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, tuple[int, int] | None]]:
        t: dict[str, tuple[torch.Tensor, tuple[int, int] | None]] = {
            "model.embed_tokens.weight": (self.embed, None),
            "model.norm.weight": (self.norm, None),
        }
        if self.lm_head is not None:
            t["lm_head.weight"] = (self.lm_head, None)
        for i, layer in enumerate(self.decoder_layers):
            p = f"model.layers.{i}."
            q, kv = layer.q_size, layer.kv_size
            qkv_rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
            for name, rows in qkv_rows.items():
                t[f"{p}self_attn.{name}_proj.weight"] = (layer.qkv, rows)
                if layer.qkv_bias is not None:
                    t[f"{p}self_attn.{name}_proj.bias"] = (layer.qkv_bias, rows)
            inter = layer.gate_up.shape[0] // 2
            t[f"{p}self_attn.o_proj.weight"] = (layer.o_proj, None)
            t[f"{p}mlp.gate_proj.weight"] = (layer.gate_up, (0, inter))
            t[f"{p}mlp.up_proj.weight"] = (layer.gate_up, (inter, 2 * inter))
            t[f"{p}mlp.down_proj.weight"] = (layer.down, None)
            t[f"{p}input_layernorm.weight"] = (layer.input_norm, None)
            t[f"{p}post_attention_layernorm.weight"] = (layer.post_norm, None)
        return t
