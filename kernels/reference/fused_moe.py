"""A mixture-of-experts MLP over routed tokens: each token's gated MLP in each of its
top-k experts, weighted and summed.

Layout::

    x             (T, H)          the tokens
    w_gate_up     (E, 2 I, H)     each expert's gate and up projections, stacked (rows
                                  [0, I) gate, [I, 2 I) up)
    w_down        (E, H, I)       each expert's down projection
    topk_ids      (T, K) int64    the experts each token is routed to (distinct per token)
    topk_weights  (T, K)          their weights (the router's, normalised or not)
    out           (T, H)          sum over k of topk_weights[t, k] *
                                  down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k]

The reference groups the (token, slot) pairs by expert (a stable sort) and runs one
matmul per expert that has tokens: no loop over tokens, none over empty experts.
Accumulates in float32 and rounds once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """(T, H): the experts' outputs of each token, weighted and summed."""
    inter = w_down.shape[2]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = rows @ w_gate_up[e].T  # (n, 2 I)
        act = F.silu(h[:, :inter].float()) * h[:, inter:].float()
        return act.to(x.dtype) @ w_down[e].T  # (n, H)

    return by_expert(x, topk_ids, topk_weights, w_gate_up.shape[0], expert)


def by_expert(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """(T, H): sum over k of topk_weights[t, k] * expert(topk_ids[t, k], x_t), with one
    call of ``expert(e, rows)`` per expert that has tokens (rows: its tokens of x, in
    token order), the weighted outputs added in expert order in float32, rounded once.
    Also the shape of a layer whose experts are quantized `Linear`s."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)  # (T K,) pairs grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    weights = topk_weights.flatten()[order].float()
    rows = order // top_k  # each pair's token
    out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        pick = slice(start, start + count)
        y = expert(e, x[rows[pick]])
        out.index_add_(0, rows[pick], y.float() * weights[pick, None])
        start += count
    return out.to(x.dtype)
