"""Architecture description of a Llama-family decoder, read from a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face configs describe it.

    kind: "linear" divides every frequency by `factor`; "llama3" applies Llama 3.1's
    wavelength-dependent scaling with `low_freq_factor`, `high_freq_factor` and
    `original_max_position_embeddings`.
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder: Llama, Mistral, Qwen2, Qwen3,
    SmolLM2, the mixture-of-experts Qwen3-MoE and Mixtral, and Gemma 3."""

    # "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3"
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    rope_scaling: RopeScaling | None = None
    # mixture of experts: the layers in `moe_layers` replace the MLP by `num_experts`
    # experts of `moe_intermediate_size` rows, `num_experts_per_tok` chosen per token by
    # softmax over the router's logits, their weights renormalised to sum 1 when
    # `norm_topk_prob`; the other layers keep the dense MLP of `intermediate_size`
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    # sliding-window attention: the layers in `sliding_layers` see the last
    # `sliding_window` positions (their own included), with RoPE of base
    # `rope_local_theta` and no scaling where that is set (Gemma), else the global
    # layers' RoPE; the others see the whole context
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    # Gemma 3's shape: the MLP's activation ("silu" or "gelu_tanh", gelu's tanh form), a
    # norm on the attention's and on the MLP's output before each residual add
    # (`post_norms`), embeddings times sqrt(hidden) (`embed_scale`), the attention's
    # softmax scale (None: 1 / sqrt(head_dim)), and the logits' soft cap
    # (cap * tanh(logits / cap); None: none)
    hidden_act: str = "silu"
    post_norms: bool = False
    embed_scale: bool = False
    attention_scale: float | None = None
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "model"  # identifies the weights: part of the KV page-hash namespace

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1.."
                f"num_experts ({self.num_experts})"
            )

    def max_model_len(self, requested: int | None) -> int:
        """The context a server of this model offers: ``requested`` (a setting; None or 0
        for the model's own), never past what the model was trained for."""
        return min(requested or self.max_position_embeddings, self.max_position_embeddings)
