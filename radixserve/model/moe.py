"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router and stacked experts.

The router is a float (E, hidden) matrix: a token's expert logits, softmax over all E in
float32, the top k kept, and their weights renormalised to sum 1 when the config says
(`norm_topk_prob`; Mixtral always does, which is the same as a softmax over the top k
logits). Each expert is a gated MLP like the dense one (silu(gate) * up, then down).

Experts in the compute dtype are stored stacked, one weight per projection —
``gate_up`` (E, 2 I, hidden: each expert's gate rows then its up rows) and ``down``
(E, hidden, I) — and run by the kernel set's ``fused_moe`` (the torch reference groups
tokens by expert, the Triton kernel is a grouped GEMM over sorted token blocks).
Quantized experts (int8 / int4, weight-only, as the dense layers take them) are one
`Linear` per expert and projection, run expert by expert over that expert's tokens
(`by_expert`: the reference's grouping, so both sum in the same order). The router stays
in the compute dtype whatever the quantization: a rounded router logit changes which
experts a token goes to, not just its output's last bits.

With tensor parallelism each rank holds every expert's share of the intermediate rows
(column-parallel gate/up, row-parallel down, the partial sums all-reduced by the layer
as for the dense MLP) and the whole router.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels.ops import KernelOps
from radixserve.kernels.reference.fused_moe import by_expert
from radixserve.model.config import ModelConfig
from radixserve.model.qlinear import Linear, make_linear
from radixserve.model.quant import Scheme


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) in ``dtype``, expert ids (T, k) int64) from router logits (T, E)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class MoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        inter: int,  # this rank's intermediate rows of each expert
        schemes: list[tuple[Scheme, Scheme]],  # each expert's (gate_up, down) scheme
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        e, h = config.num_experts, config.hidden_size
        self.num_experts, self.inter = e, inter
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        empty = partial(torch.empty, dtype=dtype, device=device)
        # Uninitialised: every value is overwritten by load_weights (checked there).
        self.router = nn.Parameter(empty(e, h), requires_grad=False)
        self.gate_up: nn.Parameter | nn.ModuleList
        self.down: nn.Parameter | nn.ModuleList
        self.quantized = any(s != "none" for pair in schemes for s in pair)
        if not self.quantized:
            self.gate_up = nn.Parameter(empty(e, 2 * inter, h), requires_grad=False)
            self.down = nn.Parameter(empty(e, h, inter), requires_grad=False)
        else:
            self.gate_up = nn.ModuleList(
                make_linear(s, 2 * inter, h, dtype, device) for s, _ in schemes
            )
            self.down = nn.ModuleList(make_linear(s, h, inter, dtype, device) for _, s in schemes)

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """(T, hidden): each token's experts' outputs, weighted and summed."""
        weights, ids = route(F.linear(x, self.router), self.top_k, self.renormalize, x.dtype)
        if not self.quantized:
            assert isinstance(self.gate_up, torch.Tensor) and isinstance(self.down, torch.Tensor)
            return ops.fused_moe(x, self.gate_up, self.down, ids, weights)
        gate_up, down = self.gate_up, self.down
        assert isinstance(gate_up, nn.ModuleList) and isinstance(down, nn.ModuleList)

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            up = ops.silu_and_mul(_linear(gate_up, e)(rows))
            return _linear(down, e)(up)

        return by_expert(x, ids, weights, self.num_experts, expert)


def _linear(layers: nn.ModuleList, e: int) -> Linear:
    layer = layers[e]
    assert isinstance(layer, Linear)
    return layer
