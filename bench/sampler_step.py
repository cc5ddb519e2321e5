"""Micro-benchmark: one sampling step of 16 temperature rows at vocabulary 49,152, the
sampler against the full-sort algorithm it replaced, measured in one run.

The baseline (`full_sort_sample_rows`) is the sampler as it was: every row's logits
sorted with their ids (a stable descending sort), the filters applied to the sorted
row, and the draw made with `torch.multinomial` over all V sorted positions. It is kept
here only as the baseline. `full_sort_inverse_cdf` is the reference the sampler's draws
are checked against (here and in `tests/engine/test_sampler.py`): the same full sort
with ids, drawn by inverse CDF with the uniform the sampler takes from the same
generator — so a difference can only come from the sampler's values-only ordering.

Each case times a whole `Sampler` call (16 rows, float32 logits: a model-like spread,
N(0, 1) scaled by 2.5 with 20 stand-out tokens per row) against the same call with the
baseline draw, interleaved, and checks on the way (untimed) that seeded rows drew the
reference's tokens. Prints one table: median ms per step and the ratio baseline / new, and the ratio
of the best step of each (the less a busy machine disturbs it).

    .venv/bin/python bench/sampler_step.py [--threads N] [--repeats N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.engine.sampler import Sampler, step_generator  # noqa: E402
from radixserve.engine.sampling_params import SamplingParams  # noqa: E402

VOCAB = 49_152
ROWS = 16

#: name -> the 16 rows' parameters (seeded rows carry a seed)
CASES: dict[str, list[SamplingParams]] = {
    "temperature 0.7, seeded": [SamplingParams(temperature=0.7, seed=i) for i in range(ROWS)],
    "temperature 0.7, unseeded": [SamplingParams(temperature=0.7)] * ROWS,
    "top_k 50, seeded": [SamplingParams(temperature=0.7, top_k=50, seed=i) for i in range(ROWS)],
    "top_p 0.9, seeded": [SamplingParams(temperature=0.7, top_p=0.9, seed=i) for i in range(ROWS)],
    "min_p 0.05, seeded": [SamplingParams(min_p=0.05, seed=i) for i in range(ROWS)],
    "mixed": [
        SamplingParams(
            temperature=0.7,
            top_k=(0, 40, 500, 0)[i % 4],
            top_p=(1.0, 0.95, 1.0, 0.8)[i % 4],
            seed=i if i % 2 else None,
        )
        for i in range(ROWS)
    ],
}


def full_sort_sample_rows(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """The baseline: one token per row of float32 logits `x` (S, V); (S,) int64."""
    probs, order = _full_sort_probs(x, params)  # (S, V), (S, V) sorted descending
    choice = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)  # (S,)
    shared = [j for j, g in enumerate(generators) if g is None]
    if shared:
        rows = torch.tensor(shared, dtype=torch.int64, device=x.device)  # (R,)
        choice[rows] = torch.multinomial(probs[rows], 1).squeeze(1)
    for j, g in enumerate(generators):
        if g is not None:
            choice[j] = torch.multinomial(probs[j], 1, generator=g)[0]
    return order.gather(1, choice.unsqueeze(1)).squeeze(1)


def full_sort_inverse_cdf(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """The reference for seeded rows: the full sort with ids, one uniform per row from
    its generator, located in the sorted row's cumulative mass; (S,) int64 token ids."""
    probs, order = _full_sort_probs(x, params)  # (S, V), (S, V) sorted descending
    choice = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)  # (S,)
    for j, g in enumerate(generators):
        if g is None:
            raise ValueError("the reference draws seeded rows only")
        cdf = probs[j].double().cumsum(dim=0)  # (V,)
        u = torch.rand(1, dtype=torch.float64, device=x.device, generator=g)
        last = int((probs[j] > 0).nonzero().max())  # the kept prefix's last position
        choice[j] = min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), last)
    return order.gather(1, choice.unsqueeze(1)).squeeze(1)


def _full_sort_probs(
    x: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k, top-p and min-p over every row sorted with its ids: probs
    (S, V) in sorted order, filtered-out entries 0, and order (S, V) the sorted ids."""
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
    mass_before = torch.cumsum(probs, dim=-1) - probs  # (S, V)
    outside_nucleus = mass_before >= top_p.unsqueeze(1)  # (S, V)
    outside_nucleus[:, 0] = False
    probs = probs.masked_fill(outside_nucleus, 0.0)
    min_p = torch.tensor([p.min_p for p in params], device=device)  # (S,)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < (min_p * probs[:, 0]).unsqueeze(1), 0.0)
    broken = ~torch.isfinite(sorted_logits[:, 0])  # (S,)
    if bool(broken.any()):
        probs[broken] = 0.0
        probs[broken, 0] = 1.0
    return probs, order


def model_like_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """(rows, vocab) float32: N(0, 1) * 2.5 with 20 tokens per row raised by 4 to 12."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 2.5
    top = torch.randint(0, vocab, (rows, 20), generator=gen)
    return logits.scatter_add_(1, top, 4.0 + 8.0 * torch.rand(rows, 20, generator=gen))


def _generators(params: Sequence[SamplingParams], step: int) -> list[torch.Generator | None]:
    """Fresh per-draw generators, as the engine makes them."""
    return [step_generator(p.seed, 0, step, "cpu") for p in params]


def _baseline_step(logits: torch.Tensor, params, generators) -> torch.Tensor:
    """The baseline's step for rows without masks, penalties or greedy rows."""
    return full_sort_sample_rows(logits.to(torch.float32, copy=True), params, generators)


def time_case(params: list[SamplingParams], repeats: int) -> dict[str, float]:
    """Median ms per step of the sampler and of the baseline, interleaved; raises if a
    seeded row draws another token than the reference."""
    sampler = Sampler()
    new_call: Callable[..., torch.Tensor] = lambda lg, gens: sampler(  # noqa: E731
        lg, params, gens, [0] * ROWS, ()
    )
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    times: dict[str, list[float]] = {"new": [], "baseline": []}
    for step in range(repeats + 1):  # the first round warms up
        logits = model_like_logits(ROWS, VOCAB, seed=step)
        tokens = {}
        for name in ("new", "baseline"):
            gens = _generators(params, step)
            start = time.perf_counter()
            tokens[name] = (
                new_call(logits, gens) if name == "new" else _baseline_step(logits, params, gens)
            )
            if step:
                times[name].append((time.perf_counter() - start) * 1000.0)
        if seeded:
            reference = full_sort_inverse_cdf(
                logits[seeded], [params[i] for i in seeded],
                [g for g in _generators(params, step) if g is not None],
            )  # fmt: skip
            if not torch.equal(tokens["new"][seeded], reference):
                raise AssertionError(f"seeded rows drew other tokens than the reference at {step}")
    new_ms, base_ms = statistics.median(times["new"]), statistics.median(times["baseline"])
    best_new, best_base = min(times["new"]), min(times["baseline"])
    return {"new_ms": new_ms, "baseline_ms": base_ms, "ratio": base_ms / new_ms,
            "best_new_ms": best_new, "best_baseline_ms": best_base,
            "best_ratio": best_base / best_new}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20, help="steps timed per case")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"sampling step: {ROWS} rows, vocabulary {VOCAB}, {args.threads} threads, "
          f"median of {args.repeats}")  # fmt: skip
    print("| case | baseline ms | new ms | baseline / new | best of each: ratio |")
    print("|---|---|---|---|---|")
    rows = []
    for name, params in CASES.items():
        row = {"case": name, **time_case(params, args.repeats)}
        rows.append(row)
        print(f"| {name} | {row['baseline_ms']:.1f} | {row['new_ms']:.2f} | "
              f"{row['ratio']:.1f}x | {row['best_ratio']:.1f}x |", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
