"""Turn one step's logits into one token per request.

Order of operations per row: mask the tokens a structured-output grammar disallows;
suppress EOS / stop ids while `min_tokens` is not reached; add logit biases; apply the
repetition, frequency and presence penalties (`penalties`); greedy rows take the argmax;
other rows divide by the temperature, keep the top-k, keep the nucleus (top-p) of what
is left, drop tokens under min_p times the best one, and draw from the renormalised
distribution with the row's own generator (seeded requests) or the global RNG
(everything else, batched).

A seeded row's generator is a function of (seed, choice index, tokens sampled so far)
(`step_generator`), not of the batch it runs in, so a stream continues identically
wherever it runs (another worker, after a preemption).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.engine.penalties import apply_logit_bias, apply_penalties
from radixserve.engine.sampling_params import SamplingParams

_SEED_MASK = 2**64 - 1


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit function of ``value``."""
    value = (value + 0x9E3779B97F4A7C15) & _SEED_MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _SEED_MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _SEED_MASK
    return value ^ (value >> 31)


def step_seed(seed: int, index: int, step: int) -> int:
    """The generator seed of choice ``index`` of a request seeded ``seed``, for the
    token after ``step`` sampled ones."""
    return _mix64(_mix64(_mix64(seed & _SEED_MASK) ^ index) ^ step)


def step_generator(
    seed: int | None, index: int, step: int, device: torch.device | str
) -> torch.Generator | None:
    """The generator of one draw, seeded from (`seed`, `index`, `step`); None when unseeded."""
    return None if seed is None else make_generator(step_seed(seed, index, step), device)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on `device` seeded from `seed` (modulo 2**64), or None when unseeded."""
    if seed is None:
        return None
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed & _SEED_MASK)
    return generator


class Sampler:
    """Stateless sampler; one instance serves every step of an engine."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        num_generated: Sequence[int],
        eos_token_ids: Sequence[int],
        *,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
        allowed: tuple[Sequence[int], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Sample one token per row.

        logits: (B, V) in any float dtype, last-position logits of B requests; not modified.
        params, generators, num_generated: one entry per row; `num_generated[i]` counts the
            tokens row i has produced before this step.
        eos_token_ids: the model's end-of-sequence ids, shared by all rows.
        prompt_ids, output_ids: each row's prompt and generated tokens, needed by rows
            with penalties (`SamplingParams.penalized`); may be None if none has one.
        allowed: (rows, mask) — for each listed row, bool (len(rows), V) of the tokens
            its grammar allows.
        Returns (B,) int64 token ids on `logits.device`. Greedy rows are exactly
        `argmax` of the masked logits (ties go to the lowest id).
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if not len(params) == len(generators) == len(num_generated) == batch:
            raise ValueError(
                f"batch of {batch} logits rows needs as many params, generators and "
                f"num_generated (got {len(params)}, {len(generators)}, {len(num_generated)})"
            )
        x = logits.to(torch.float32, copy=True)  # (B, V)
        if allowed is not None and len(allowed[0]):
            rows = torch.tensor(list(allowed[0]), dtype=torch.int64, device=x.device)  # (G,)
            x[rows] = x[rows].masked_fill(~allowed[1].to(x.device), float("-inf"))
        _suppress_early_stops(x, params, num_generated, eos_token_ids)
        apply_logit_bias(x, params)
        if any(p.penalized for p in params):
            if prompt_ids is None or output_ids is None:
                raise ValueError("rows with penalties need prompt_ids and output_ids")
            apply_penalties(x, params, prompt_ids, output_ids)
        out = torch.empty(batch, dtype=torch.int64, device=x.device)  # (B,)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            rows = torch.tensor(greedy, dtype=torch.int64, device=x.device)  # (G,)
            out[rows] = x[rows].argmax(dim=-1)
        if sampled:
            rows = torch.tensor(sampled, dtype=torch.int64, device=x.device)  # (S,)
            picked = [params[i] for i in sampled]
            out[rows] = _sample_rows(x[rows], picked, [generators[i] for i in sampled])
        return out


def _suppress_early_stops(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    num_generated: Sequence[int],
    eos_token_ids: Sequence[int],
) -> None:
    """Set EOS and stop-token logits to -inf, in place, for rows below `min_tokens`."""
    vocab = x.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, n) in enumerate(zip(params, num_generated)):
        if n >= p.min_tokens:
            continue
        banned = {t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab}
        rows.extend([i] * len(banned))
        cols.extend(sorted(banned))
    if rows:
        r = torch.tensor(rows, dtype=torch.int64, device=x.device)  # (N,)
        c = torch.tensor(cols, dtype=torch.int64, device=x.device)  # (N,)
        x[r, c] = float("-inf")


def _sample_rows(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Draw one token per row of float32 logits `x` (S, V); returns (S,) int64."""
    probs, order = _filtered_probs(x, params)  # (S, V), (S, V) sorted descending
    choice = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)  # (S,)
    shared = [j for j, g in enumerate(generators) if g is None]
    if shared:
        rows = torch.tensor(shared, dtype=torch.int64, device=x.device)  # (R,)
        choice[rows] = torch.multinomial(probs[rows], 1).squeeze(1)
    for j, g in enumerate(generators):
        if g is not None:
            choice[j] = torch.multinomial(probs[j], 1, generator=g)[0]
    return order.gather(1, choice.unsqueeze(1)).squeeze(1)


def _filtered_probs(
    x: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k, top-p and min-p applied to logits `x` (S, V).

    Returns (probs, order): probs (S, V) over tokens sorted by descending logit (ties by
    ascending id) with filtered-out entries at 0, and order (S, V) mapping sorted
    positions back to token ids. The most likely token always keeps positive mass.
    """
    vocab = x.shape[1]
    device = x.device
    temps = torch.tensor([p.temperature for p in params], device=device)  # (S,)
    top_k = torch.tensor(
        [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device
    )  # (S,)
    top_p = torch.tensor([p.top_p for p in params], device=device)  # (S,)

    scaled = x / temps.unsqueeze(1)  # (S, V)
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # (S, V) each
    rank = torch.arange(vocab, device=device).unsqueeze(0)  # (1, V)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))

    probs = torch.softmax(sorted_logits, dim=-1)  # (S, V)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # (S, V) mass of strictly better tokens
    outside_nucleus = mass_before >= top_p.unsqueeze(1)  # (S, V)
    outside_nucleus[:, 0] = False  # the best token stays, even for a top_p that underflows
    probs = probs.masked_fill(outside_nucleus, 0.0)
    min_p = torch.tensor([p.min_p for p in params], device=device)  # (S,)
    if bool((min_p > 0).any()):  # sorted: position 0 holds the best token
        probs = probs.masked_fill(probs < (min_p * probs[:, 0]).unsqueeze(1), 0.0)

    # A row whose logits are all -inf (or NaN) has no distribution: pick its first token.
    broken = ~torch.isfinite(sorted_logits[:, 0])  # (S,)
    if bool(broken.any()):
        probs[broken] = 0.0
        probs[broken, 0] = 1.0
    return probs, order
