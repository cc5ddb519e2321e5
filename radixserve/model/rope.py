"""Rotary position embedding tables with the checkpoint's theta and scaling (HF rotate-half form)."""

from __future__ import annotations

import math

import torch

from radixserve.model.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies, scaled as the checkpoint asks."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {scaling.kind!r}")


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Llama 3.1: long wavelengths slow down by `factor`, short ones stay, a smooth band between.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to `max_positions`, computed once at start-up;
    the `rope` kernel (radixserve.kernels) rotates q and k in place with them."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (P, D/2) float32
        self.cos = freqs.cos().to(device)  # (P, D/2) float32
        self.sin = freqs.sin().to(device)
