"""Where each model weight comes from in a checkpoint: `weight_layout` (a model
weight's Hugging Face pieces, named as its family's checkpoints name them:
`radixserve.model.families`), `shard_layout` (the pieces one tensor-parallel rank
holds), `quant_targets` (the matrices a quantization plan covers) and
`checkpoint_schemes`."""

from __future__ import annotations

from radixserve.model.config import ModelConfig
from radixserve.model.families.registry import by_name
from radixserve.model.quant import Scheme, Target
from radixserve.model.tp import Take, TPShard

Plan = dict[str, Scheme]  # model weight ("embed", "layers.3.qkv", ...) → scheme
#: a model weight's checkpoint piece: (checkpoint name, first row in the model weight, shape)
Layout = dict[str, list[tuple[str, int, tuple[int, ...]]]]
#: a model weight's piece on one rank: (checkpoint name, first row in the model weight,
#: the piece's shape there, the slice of the checkpoint tensor it is, None: all of it)
Piece = tuple[str, int, tuple[int, ...], Take | None]


def weight_layout(c: ModelConfig) -> Layout:
    """Model weight ("layers.3.qkv") → its checkpoint pieces (name, first row, shape)."""
    h, q = c.hidden_size, c.num_heads * c.head_dim
    kv, ff = c.num_kv_heads * c.head_dim, c.intermediate_size
    norms = by_name(c.architecture).names.norms
    out: Layout = {
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
        if c.qk_norm:
            out[key + "q_norm"] = [(f"{p}self_attn.q_norm.weight", 0, (c.head_dim,))]
            out[key + "k_norm"] = [(f"{p}self_attn.k_norm.weight", 0, (c.head_dim,))]
        out[key + "o_proj"] = [(f"{p}self_attn.o_proj.weight", 0, (h, q))]
        if i in c.moe_layers:
            out.update(_moe_layout(c, p, key))
        else:
            out[key + "gate_up"] = [
                (f"{p}mlp.gate_proj.weight", 0, (ff, h)),
                (f"{p}mlp.up_proj.weight", ff, (ff, h)),
            ]
            out[key + "down"] = [(f"{p}mlp.down_proj.weight", 0, (h, ff))]
        for norm, name in norms.items():  # Gemma's: before and after attention and MLP
            out[key + norm] = [(f"{p}{name}.weight", 0, (h,))]
    return out


def _moe_layout(c: ModelConfig, p: str, key: str) -> Layout:
    """A mixture-of-experts layer's router and experts, by the family's checkpoint names
    (Mixtral's ``block_sparse_moe`` with w1, w3, w2; Qwen3-MoE's ``mlp`` with gate_proj,
    up_proj, down_proj)."""
    h, ff = c.hidden_size, c.moe_intermediate_size
    names = by_name(c.architecture).names
    block, (gate, up, down) = names.moe_block, names.experts
    out: Layout = {key + "moe.router": [(f"{p}{block}.gate.weight", 0, (c.num_experts, h))]}
    for e in range(c.num_experts):
        x = f"{p}{block}.experts.{e}."
        out[f"{key}moe.gate_up.{e}"] = [(f"{x}{gate}.weight", 0, (ff, h)),
                                        (f"{x}{up}.weight", ff, (ff, h))]  # fmt: skip
        out[f"{key}moe.down.{e}"] = [(f"{x}{down}.weight", 0, (h, ff))]
    return out


def shard_layout(c: ModelConfig, tp: TPShard) -> dict[str, list[Piece]]:
    """`weight_layout` on rank ``tp.rank`` of ``tp.size``: each model weight's pieces as
    that rank holds them, and the slice of the checkpoint tensor each is
    (`radixserve.model.tp` says which split each weight takes)."""
    full = weight_layout(c)
    if tp.size == 1:
        return {key: [(n, s, shape, None) for n, s, shape in p] for key, p in full.items()}
    d, h = c.head_dim, c.hidden_size
    q, q0 = tp.q_heads(c) * d, tp.rank * tp.q_heads(c) * d
    kv, kv0 = tp.kv_heads(c) * d, tp.kv_head_start(c) * d
    v0, v1 = tp.vocab_range(c)
    out: dict[str, list[Piece]] = {}
    for key, pieces in full.items():
        kind = key.rsplit(".", 1)[-1]
        ff = tp.ff(c)
        if kind.isdigit():  # an expert's projection ("layers.3.moe.gate_up.7")
            kind, ff = key.rsplit(".", 2)[-2], tp.moe_ff(c)
        ff0 = tp.rank * ff
        names = [name for name, _, _ in pieces]
        rest = pieces[0][2][1:]  # a matrix's inputs; () for a bias
        if kind in ("embed", "lm_head"):  # vocab-parallel
            out[key] = [(names[0], 0, (v1 - v0, h), (0, v0, v1))]
        elif kind in ("qkv", "qkv_bias"):  # column-parallel: this rank's heads
            out[key] = [(names[0], 0, (q, *rest), (0, q0, q0 + q)),
                        (names[1], q, (kv, *rest), (0, kv0, kv0 + kv)),
                        (names[2], q + kv, (kv, *rest), (0, kv0, kv0 + kv))]  # fmt: skip
        elif kind == "o_proj":  # row-parallel: this rank's heads' inputs
            out[key] = [(names[0], 0, (h, q), (1, q0, q0 + q))]
        elif kind == "gate_up":  # column-parallel: this rank's intermediate rows of each
            out[key] = [(names[0], 0, (ff, h), (0, ff0, ff0 + ff)),
                        (names[1], ff, (ff, h), (0, ff0, ff0 + ff))]  # fmt: skip
        elif kind == "down":  # row-parallel
            out[key] = [(names[0], 0, (h, ff), (1, ff0, ff0 + ff))]
        else:  # norms: every rank holds them whole
            out[key] = [(n, s, shape, None) for n, s, shape in pieces]
    return out


def quant_targets(c: ModelConfig, tp: TPShard | None = None) -> dict[str, Target]:
    """The matrices `plan_schemes` chooses a scheme for (norms, biases and MoE routers
    stay float), as rank ``tp`` holds them."""
    return {
        key: Target(
            tuple((name, shape[0]) for name, _, shape, _ in pieces),
            pieces[0][2][1],
            embedding=key == "embed",
        )
        for key, pieces in shard_layout(c, tp or TPShard()).items()
        if len(pieces[0][2]) == 2 and not key.endswith("router")
    }


def checkpoint_schemes(c: ModelConfig, plan: Plan) -> dict[str, Scheme]:
    """Checkpoint tensor name → the scheme its model weight is stored in."""
    return {
        name: plan.get(key, "none")
        for key, pieces in weight_layout(c).items()
        for name, _, _ in pieces
        if len(pieces[0][2]) == 2 and not key.endswith("router")
    }
