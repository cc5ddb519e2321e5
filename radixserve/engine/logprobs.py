"""Log-probabilities of chosen tokens and their top alternatives, batched over the rows
that ask for them (the rest of a step pays nothing).

They come from the raw model distribution, ``log_softmax`` of the logits as the model
produced them: before temperature, penalties, logit biases and grammar masks (the
OpenAI API's and vLLM's default). A prompt token's log-probability is read from the
logits of the position before it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from radixserve.engine.outputs import NEG_INF_LOGPROB, TokenLogprob


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    """For each row of ``logits`` (R, V): the log-probability of ``token_ids[r]`` and the
    ``num_top[r]`` most likely tokens. One log_softmax and one top-k for all R rows."""
    if logits.shape[0] != len(token_ids) or len(token_ids) != len(num_top):
        raise ValueError("logits rows, token_ids and num_top must have one entry per row")
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=lp.device)  # (R,)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()  # (R,)
    k = min(max(num_top), lp.shape[1])
    top_vals: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if k > 0:  # top-k, not a sort: a full sort of (R, V) costs ten times more per step
        # one more than asked: an equal (k+1)-th shows a tie at the cut
        values, order = lp.topk(min(k + 1, lp.shape[1]), dim=-1)  # (R, k + 1), descending
        top_vals, top_ids = values[:, :k].tolist(), order[:, :k].tolist()
        tied = (values[:, 1:] == values[:, :-1]).any(-1)  # torch.topk orders equals freely
        for r in tied.nonzero().flatten().tolist():
            top_vals[r], top_ids[r] = _lowest_ids_first(lp[r], values[r, k - 1], k)
    return [
        TokenLogprob(
            token_id=int(t),
            logprob=_finite(c),
            top_ids=tuple(top_ids[r][: num_top[r]]),
            top_logprobs=tuple(_finite(v) for v in top_vals[r][: num_top[r]]),
        )
        for r, (t, c) in enumerate(zip(token_ids, chosen))
    ]


def _lowest_ids_first(
    row: torch.Tensor, cut: torch.Tensor, k: int
) -> tuple[list[float], list[int]]:
    """The ``k`` most likely ids of ``row`` (V,), whose ``k``-th value is ``cut``, equal
    values lowest id first: greedy sampling's argmax takes the lowest, so the chosen
    token leads its top list."""
    ids = (row >= cut).nonzero().flatten()  # ascending
    order = torch.sort(row[ids], descending=True, stable=True).indices[:k]
    return row[ids[order]].tolist(), ids[order].tolist()
