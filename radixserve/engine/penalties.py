"""Presence, frequency and repetition penalties and logit biases, batched on the device.

For a row with generated tokens ``out`` and prompt ``prompt`` (``count[t]`` = how often
token t occurs in ``out``):

    repetition (vLLM, CTRL):  l[t] = l[t] / r if l[t] > 0 else l[t] * r,  t in prompt ∪ out
    frequency and presence (OpenAI):  l[t] -= frequency * count[t] + presence * (count[t] > 0)
    logit bias (OpenAI):  l[t] += bias[t]

applied in that order (penalties, then biases), in place, to float32 logits, only on
the rows that have them: each is one scatter over the rows concerned.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.engine.sampling_params import SamplingParams


def _occurrences(rows: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """counts (R, V) float32: how often each token id occurs in each row's sequence."""
    width = max((len(r) for r in rows), default=0)
    index = torch.full((len(rows), width + 1), vocab, dtype=torch.int64)  # (R, W+1); V = pad
    for i, seq in enumerate(rows):
        if seq:
            index[i, : len(seq)] = torch.tensor(list(seq), dtype=torch.int64)
    index = index.to(device)
    counts = torch.zeros((len(rows), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]  # (R, V)


def apply_penalties(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> None:
    """Apply the penalties of every row that has one to float32 logits ``x`` (B, V)."""
    picked = [i for i, p in enumerate(params) if p.penalized]
    if not picked:
        return
    vocab, device = x.shape[1], x.device
    rows = torch.tensor(picked, dtype=torch.int64, device=device)  # (R,)
    sub = x[rows]  # (R, V)
    counts = _occurrences([output_ids[i] for i in picked], vocab, device)  # (R, V)
    rep = torch.tensor([params[i].repetition_penalty for i in picked], device=device)  # (R,)
    if bool((rep != 1.0).any()):
        seen = (counts > 0) | (_occurrences([prompt_ids[i] for i in picked], vocab, device) > 0)
        r = rep.unsqueeze(1)  # (R, 1)
        penalized = torch.where(sub > 0, sub / r, sub * r)
        sub = torch.where(seen, penalized, sub)
    freq = torch.tensor([params[i].frequency_penalty for i in picked], device=device)  # (R,)
    pres = torch.tensor([params[i].presence_penalty for i in picked], device=device)  # (R,)
    sub = sub - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).float()
    x[rows] = sub


def apply_logit_bias(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add every row's logit biases to float32 logits ``x`` (B, V), in place."""
    vocab = x.shape[1]
    entries = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < vocab]
    if not entries:
        return
    rows, cols, vals = zip(*entries)
    device = x.device
    x.index_put_(
        (
            torch.tensor(rows, dtype=torch.int64, device=device),  # (N,)
            torch.tensor(cols, dtype=torch.int64, device=device),  # (N,)
        ),
        torch.tensor(vals, dtype=torch.float32, device=device),  # (N,)
        accumulate=True,
    )
