"""Tiny random Hugging Face checkpoints (safetensors + tokenizer.json) for fast tests.

`write_tiny_checkpoint` saves a small random Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE /
Mixtral / Gemma 3 causal LM with
`transformers` and a matching small byte-level BPE tokenizer (trained in code on a fixed
corpus, so it is deterministic) whose ids 0, 1, 2 are `<|endoftext|>`, `<|im_start|>`
(bos) and `<|im_end|>` (eos), and a ChatML chat template. `write_tiny_gguf` writes the
same weights as a llama.cpp-style GGUF file. No pytest fixtures here: test modules
anywhere may import it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is some text for a tiny tokenizer.",
    "def main():\n    return 42  # the answer\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and 3.14159, 2025-01-01.",
    "user assistant system: how are you? I am fine, thank you.",
    "Paged attention keeps the KV cache in fixed-size pages; radix trees share prefixes.",
]

_ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}
# the GGUF architecture each is written as (Mixtral: llama with experts)
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


def build_tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """A byte-level BPE of exactly `vocab_size` ids (every byte encodable), ChatML specials.

    The merges learnt from a small corpus fill the vocabulary up to a few hundred ids; the
    rest are `<extra_N>` added tokens, so every id of a tiny model decodes to text.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    # Pad with plain added tokens so that every id below vocab_size decodes to something.
    fillers = range(tok.get_vocab_size(), vocab_size)
    tok.add_tokens([AddedToken(f"<extra_{i}>", normalized=False, special=False) for i in fillers])
    return tok


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Make norms and biases non-trivial so a mis-mapped tensor changes the logits, and
    MoE routers decisive (a token's experts differ clearly from the others)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):  # a router (dense MLPs have gate_proj)
                param.copy_(torch.randn(param.shape, generator=gen))


def build_tiny_model(
    arch: str = "llama",
    tie: bool = True,
    rope_scaling: dict[str, Any] | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> transformers.PreTrainedModel:
    """The random transformers model `write_tiny_checkpoint` saves (same arguments)."""
    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {sorted(_ARCHS)}, got {arch!r}")
    config_cls, model_cls = _ARCHS[arch]
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    if rope_scaling is not None:
        fields["rope_scaling"] = {"rope_theta": fields["rope_theta"], **rope_scaling}
    fields.update(config_overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).to(dtype).eval()
    _randomize(model, seed)
    return model


def write_tiny_checkpoint(
    tmpdir: str | Path,
    arch: str = "llama",
    tie: bool = True,
    rope_scaling: dict[str, Any] | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random `arch` checkpoint into `tmpdir` and return that directory.

    Default shape: hidden 64, 2 layers, 4 heads, 2 kv heads (head_dim 16), intermediate
    128, max_position_embeddings 256, rope_theta 10000; `config_overrides` replace any
    transformers config field. `rope_scaling` is a transformers dict such as
    `{"rope_type": "llama3", "factor": 8.0, ...}`. Same arguments → same files.
    """
    root = Path(tmpdir)
    root.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(arch, tie, rope_scaling, vocab_size, seed, dtype, **config_overrides)
    model.save_pretrained(root)
    build_tiny_tokenizer(vocab_size).save(str(root / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "add_bos_token": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return root


_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
}
# Gemma's norms: its post_attention_layernorm is the attention output's, ffn_norm the
# MLP's input norm
_GGUF_GEMMA = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def _gguf_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors as a GGUF stores them: transformers 5's fused experts
    (`mlp.experts.gate_up_proj` (E, 2 I, H), `down_proj`) as llama.cpp's three stacks
    (named here `mlp.experts.{gate,up,down}_exps`)."""
    out = []
    for name, tensor in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out += [(name.replace("gate_up_proj", "gate_exps"), gate),
                    (name.replace("gate_up_proj", "up_exps"), up)]  # fmt: skip
        elif name.endswith("mlp.experts.down_proj"):
            out.append((name.replace("down_proj", "down_exps"), tensor))
        else:
            out.append((name, tensor))
    return out


def _gguf_name(name: str, arch: str = "llama") -> str:
    if ".mlp.experts." in name:  # model.layers.N.mlp.experts.gate_exps
        _, _, layer, _, _, part = name.split(".")
        return f"blk.{layer}.ffn_{part}.weight"
    stem, kind = name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        names = {**_GGUF_BLOCK, **_GGUF_GEMMA} if arch == "gemma3" else _GGUF_BLOCK
        return f"blk.{layer}.{names[part]}.{kind}"
    return f"{_GGUF_GLOBAL[stem]}.{kind}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rotate-half → interleaved rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_rope_factors(scaling: dict[str, Any], head_dim: int, theta: float) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp writes for Llama 3 RoPE scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_tiny_gguf(
    path: str | Path,
    arch: str = "llama",
    tie: bool = True,
    rope_scaling: dict[str, Any] | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    f16: bool = False,
    quant: str | None = None,
    **config_overrides: Any,
) -> Path:
    """Write the `build_tiny_model` weights (same arguments) as a llama.cpp-style GGUF.

    `arch` is "llama" (Q/K rows permuted as llama.cpp does), "qwen2" or "qwen3" (not
    permuted; Qwen3's q/k norms as `attn_q_norm`/`attn_k_norm`), "gemma3" (norms stored
    as 1 + w, as llama.cpp's converter does; its window and RoPE bases), "qwen3_moe" (GGUF
    `qwen3moe`) or "mixtral" (GGUF `llama` with experts, Q/K permuted): experts stacked as
    `ffn_gate_exps`/`ffn_up_exps`/`ffn_down_exps`, routers as `ffn_gate_inp`, and a dense
    layer of Qwen3-MoE (`mlp_only_layers`) as `ffn_gate`/`ffn_up`/`ffn_down`.
    Linear RoPE scaling goes in metadata; llama3 scaling as a `rope_freqs` tensor. With
    `f16` the 2-D weights are stored as F16 (norms and biases stay F32); with `quant`
    ("Q4_0", "Q4_1", "Q8_0") they are quantized by gguf's own quantizer.
    """
    model = build_tiny_model(arch, tie, rope_scaling, vocab_size, seed, **config_overrides)
    cfg = model.config
    tokenizer = build_tiny_tokenizer(vocab_size)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    path = Path(path)
    permuted = arch in ("llama", "mixtral")
    arch = _GGUF_ARCH.get(arch, arch)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_vocab_size(vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        full = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_float32("gemma3.rope.freq_base_swa",
                           cfg.rope_parameters["sliding_attention"]["rope_theta"])  # fmt: skip
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch in ("qwen3moe", "llama") and getattr(cfg, "num_experts_per_tok", 0):
        experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_weights_norm(getattr(cfg, "norm_topk_prob", True))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [3 if t in SPECIAL_TOKENS else 4 if t.startswith("<extra_") else 1 for t in tokens]
    )
    writer.add_token_merges([" ".join(m) for m in merges])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)
    if rope_scaling and rope_scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling["factor"])
    elif rope_scaling and rope_scaling["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope_scaling, head_dim, 1e4))
    for name, tensor in _gguf_tensors(model):
        if tie and name == "lm_head.weight":
            continue
        data = tensor.float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0
        if permuted and ".q_proj." in name:
            data = llamacpp_permute(data, cfg.num_attention_heads)
        elif permuted and ".k_proj." in name:
            data = llamacpp_permute(data, cfg.num_key_value_heads)
        if f16 and data.ndim == 2:
            data = data.astype(np.float16)
        if quant and data.ndim >= 2:
            kind = gguf.GGMLQuantizationType[quant]
            packed = gguf.quants.quantize(np.ascontiguousarray(data), kind)
            writer.add_tensor(_gguf_name(name, arch), packed, raw_shape=packed.shape,
                              raw_dtype=kind)  # fmt: skip
            continue
        writer.add_tensor(_gguf_name(name, arch), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
