"""The gated MLP's activation: silu(gate) * up.

Layout: x (T, 2 * I) is the fused gate/up projection, gate = x[:, :I], up = x[:, I:];
the result is (T, I) in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
