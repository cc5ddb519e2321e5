"""Turn one step's logits into one token per request.

Order of operations per row: mask the tokens a structured-output grammar disallows;
suppress EOS / stop ids while `min_tokens` is not reached; add logit biases; apply the
repetition, frequency and presence penalties (`penalties`); rows whose next token is
forced (a thinking budget spent: `thinking_budget`) keep only that token, a mask that
leaves every other row and every draw as they were; greedy rows take the argmax;
other rows divide by the temperature, keep the top-k, keep the nucleus (top-p) of what
is left, drop tokens under min_p times the best one, and draw from the renormalised
distribution with the row's own generator (seeded requests) or the global RNG
(everything else, batched).

A seeded row's generator is a function of (seed, choice index, tokens sampled so far)
(`step_generator`), not of the batch it runs in, so a stream continues identically
wherever it runs (another worker, after a preemption).

The filters are defined on the row's tokens in stable descending order (by logit, ties
by ascending id), and every draw is an inverse-CDF lookup over that order: one uniform
per row, from the row's own generator (seeded) or the global RNG (unseeded), scaled by
the kept mass and located in the kept prefix's cumulative sum. Sorting the ids along
with the logits cost ~5 ms a row (49,152 tokens); `sample_rows` orders the values only:
by partial selection (`torch.topk`) for rows with a small top-k, by a SIMD sort of the
values for the rest. Softmax, the nucleus and min-p then run on the same values with
the same ops, and the drawn position is mapped back to its id by its value and its place
among the tokens tied with it, so a draw is exactly the one the full sort with ids would
make with the same uniform (`tests/engine/test_sampler.py` compares them).

Seeded draws changed tokens with this sampler (the same seed gives other tokens than
before it): the earlier draw was `torch.multinomial`'s race, one exponential per kept
token, which for a temperature-only row is one per vocabulary entry (~0.7 ms a row at
49,152) — the one cost that kept seeded steps from the others' speed. One uniform
draws from the same distribution, and a seed still fixes every token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from radixserve.engine.penalties import apply_logit_bias, apply_penalties
from radixserve.engine.sampling_params import SamplingParams

_SEED_MASK = 2**64 - 1
#: top-k rows up to this k take their k best by partial selection (torch.topk); past it,
#: sorting the row's values is cheaper (16 rows of 49,152: topk(128) ~1.2 ms, the sort
#: ~1.6 ms, topk(1024) ~6 ms, on one AVX-512 core)
PARTIAL_SELECTION_MAX_K = 128


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
    """One instance serves every step of an engine; it keeps no sampling state."""

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
        forced: tuple[Sequence[int], Sequence[int]] | None = None,
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
        forced: (rows, token ids) — each listed row takes that token (every other logit
            is masked; the row still draws, so the random streams are unchanged).
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
        if _plain_greedy(params, num_generated, allowed, forced):  # nothing to mask: argmax
            return logits.float().argmax(dim=-1)
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
        if forced is not None and len(forced[0]):
            _force(x, forced[0], forced[1])
        out = torch.empty(batch, dtype=torch.int64, device=x.device)  # (B,)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            rows = torch.tensor(greedy, dtype=torch.int64, device=x.device)  # (G,)
            out[rows] = x[rows].argmax(dim=-1)
        if len(sampled) == batch:  # no row to pick out
            return sample_rows(x, params, generators)
        if sampled:
            rows = torch.tensor(sampled, dtype=torch.int64, device=x.device)  # (S,)
            picked = [params[i] for i in sampled]
            gens = [generators[i] for i in sampled]
            out[rows] = sample_rows(x[rows], picked, gens)
        return out


def _plain_greedy(
    params: Sequence[SamplingParams],
    num_generated: Sequence[int],
    allowed: tuple[Sequence[int], torch.Tensor] | None,
    forced: tuple[Sequence[int], Sequence[int]] | None,
) -> bool:
    """Whether every row is greedy with nothing that changes its logits first (no grammar,
    forced token, early-stop ban, bias or penalty): the token is the logits' argmax."""
    if (allowed is not None and len(allowed[0])) or (forced is not None and len(forced[0])):
        return False
    return all(p.greedy and not p.logit_bias and not p.penalized and n >= p.min_tokens
               for p, n in zip(params, num_generated))  # fmt: skip


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


def _force(x: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int]) -> None:
    """Leave each of ``rows`` of ``x`` (B, V) one finite logit, 0 at its token, in place."""
    r = torch.tensor(list(rows), dtype=torch.int64, device=x.device)  # (F,)
    c = torch.tensor(list(token_ids), dtype=torch.int64, device=x.device)  # (F,)
    x[r] = float("-inf")
    x[r, c] = 0.0


def sample_rows(
    x: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Draw one token per row of float32 logits `x` (S, V); returns (S,) int64.

    The token the full sort with ids (a stable descending sort) would give for the same
    uniform (see the module notes), without that sort: only the values are ordered, and
    a drawn position is mapped back to its id.
    """
    vocab = x.shape[1]
    temps = torch.tensor([p.temperature for p in params], device=x.device)  # (S,)
    scaled = x / temps.unsqueeze(1)  # (S, V)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    sorted_logits = _sorted_logits(scaled, top_k)  # (S, V)
    probs = _filtered_probs(sorted_logits, params)  # (S, V)
    return _token_ids(scaled, sorted_logits, _draw_positions(probs, generators))


def _sorted_logits(scaled: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    """(S, V): each row's values in descending order (NaN first), -inf from position
    `top_k[i]` on. Rows with a small top-k take their k best by partial selection; the
    others sort their values alone."""
    device = scaled.device
    few = [i for i, k in enumerate(top_k) if k <= PARTIAL_SELECTION_MAX_K]
    many = [i for i, k in enumerate(top_k) if k > PARTIAL_SELECTION_MAX_K]
    width = max((top_k[i] for i in few), default=0)  # the columns partial selection fills
    if not few:
        out = _sorted_descending(scaled)  # (S, V)
    else:
        out = torch.full_like(scaled, float("-inf"))  # (S, V)
        rows = torch.tensor(few, dtype=torch.int64, device=device)  # (F,)
        out[rows, :width] = scaled[rows].topk(width, dim=1).values  # (F, width) descending
        if many:
            rows = torch.tensor(many, dtype=torch.int64, device=device)  # (M,)
            out[rows] = _sorted_descending(scaled[rows])
    for i in few:  # each row cut at its own top-k
        out[i, top_k[i] : width] = float("-inf")
    for i in many:
        if top_k[i] < out.shape[1]:
            out[i, top_k[i] :] = float("-inf")
    return out


def _sorted_descending(x: torch.Tensor) -> torch.Tensor:
    """Each row of `x` (R, V) in descending order, values only. On the CPU numpy sorts
    them (a SIMD sort on x86: about 0.1 ms for 49,152 floats, where torch's stable sort,
    which carries the indices along, takes about 5 ms)."""
    if x.device.type != "cpu":
        return x.sort(dim=1, descending=True).values
    ascending = np.sort(x.numpy(), axis=1)  # NaN last
    return torch.from_numpy(np.ascontiguousarray(ascending[:, ::-1]))


def _filtered_probs(sorted_logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Nucleus (top-p) and min-p applied to descending logits (S, V), -inf past top-k.

    Returns probs (S, V) over the sorted positions, filtered-out entries at 0. The most
    likely token always keeps positive mass; a row whose best logit is not finite (all
    -inf, or NaN) puts all of it on position 0. Every op is the one the full-sort
    algorithm applies to the same (S, V) values, so the probabilities are the same bits.
    """
    device = sorted_logits.device
    top_p = torch.tensor([p.top_p for p in params], device=device)  # (S,)
    probs = torch.softmax(sorted_logits, dim=-1)  # (S, V)
    mass_before = torch.cumsum(probs, dim=-1).sub_(probs)  # (S, V) mass of better tokens
    outside_nucleus = mass_before >= top_p.unsqueeze(1)  # (S, V)
    outside_nucleus[:, 0] = False  # the best token stays, even for a top_p that underflows
    probs.masked_fill_(outside_nucleus, 0.0)
    min_p = torch.tensor([p.min_p for p in params], device=device)  # (S,)
    if bool((min_p > 0).any()):  # sorted: position 0 holds the best token
        probs = probs.masked_fill(probs < (min_p * probs[:, 0]).unsqueeze(1), 0.0)
    broken = ~torch.isfinite(sorted_logits[:, 0])  # (S,)
    if bool(broken.any()):
        probs[broken] = 0.0
        probs[broken, 0] = 1.0
    return probs


def _draw_positions(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """One sorted position per row of `probs` (S, V); (S,) int64.

    Inverse CDF over each row's kept prefix (up to its last positive entry): a uniform u
    in [0, 1) times the kept mass, located in the prefix's cumulative sum (float64). A
    seeded row's u is the first float64 of its generator (rows sharing one draw in row
    order); the other rows take theirs from the global RNG in one call.
    """
    batch, vocab = probs.shape
    device = probs.device
    position = torch.arange(vocab, dtype=torch.int32, device=device)  # (V,)
    kept = (torch.where(probs > 0, position, 0).amax(dim=1) + 1).long()  # (S,) prefix lengths
    width = int(kept.max())
    u = torch.empty(batch, 1, dtype=torch.float64, device=device)  # (S, 1)
    shared = [j for j, g in enumerate(generators) if g is None]
    if shared:
        rows = torch.tensor(shared, dtype=torch.int64, device=device)  # (R,)
        u[rows] = torch.rand(len(shared), 1, dtype=torch.float64, device=device)
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand(1, dtype=torch.float64, device=device, generator=g)
    cdf = probs[:, :width].double().cumsum(dim=1)  # (S, W)
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)  # (S,)
    return torch.minimum(picked, kept - 1)  # u * total rounded up to the total


def _token_ids(
    scaled: torch.Tensor, sorted_logits: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The token at sorted position `positions[i]` of each row of `scaled` (S, V), in the
    order of a stable descending sort: by value, ties by ascending id, NaN first.

    The position's value says which tokens tie with it and how many come before them;
    the token is the right one among its ties. (S,) int64.
    """
    value = sorted_logits.gather(1, positions.unsqueeze(1))  # (S, 1)
    ahead = (scaled > value).sum(dim=1)  # (S,) tokens before the tie group
    ties = scaled == value  # (S, V)
    if bool(value.isnan().any()):  # a NaN row's position 0 is its first NaN
        ties |= scaled.isnan() & value.isnan()
    rows, cols = ties.nonzero(as_tuple=True)  # (T,) each; ascending ids within a row
    per_row = torch.bincount(rows, minlength=scaled.shape[0])  # (S,)
    first = per_row.cumsum(0) - per_row  # (S,) each row's first tie in `cols`
    return cols[first + positions - ahead]
