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
    """Shape and hyper-parameters of a Llama / Mistral / Qwen2 / Qwen3 / SmolLM2 decoder."""

    architecture: str  # "llama", "mistral", "qwen2", "qwen3"
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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "model"  # identifies the weights: part of the KV page-hash namespace

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    def max_model_len(self, requested: int | None) -> int:
        """The context a server of this model offers: ``requested`` (a setting; None or 0
        for the model's own), never past what the model was trained for."""
        return min(requested or self.max_position_embeddings, self.max_position_embeddings)
