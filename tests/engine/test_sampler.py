"""Sampler: greedy exactness, min_tokens, top-k / top-p, seeding, the sampled distribution,
and every draw equal to the full sort with ids drawing with the same uniform."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from bench.sampler_step import full_sort_inverse_cdf, full_sort_sample_rows
from radixserve.engine.sampler import (
    PARTIAL_SELECTION_MAX_K,
    Sampler,
    make_generator,
    sample_rows,
)
from radixserve.engine.sampling_params import SamplingParams

EOS = 3
CHI2_DF5_P001 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


def _sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    num_generated: Sequence[int] | None = None,
    eos: Sequence[int] = (EOS,),
) -> torch.Tensor:
    batch = logits.shape[0]
    gens = list(generators) if generators is not None else [None] * batch
    done = list(num_generated) if num_generated is not None else [0] * batch
    return Sampler()(logits, params, gens, done, eos)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_exact_argmax_with_lowest_id_on_ties(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 5000, generator=g).to(dtype)  # (B, V)
    logits[:4] = torch.randint(0, 3, (4, 5000), generator=g).to(dtype)  # many exact ties
    params = [SamplingParams(temperature=0.0)] * 8 + [SamplingParams(top_k=1)] * 8
    before = logits.clone()
    out = _sample(logits, params, eos=())
    assert out.dtype == torch.int64 and out.shape == (16,)
    assert torch.equal(out, logits.float().argmax(dim=-1))
    assert torch.equal(logits, before), "the caller's logits must not be modified"
    first_max = (logits[:4].float() == logits[:4].float().max(-1, keepdim=True).values).int()
    assert torch.equal(out[:4], first_max.argmax(dim=-1))


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(4, 10)  # (B, V)
    logits[:, EOS] = 50.0
    logits[:, 7] = 40.0  # a stop token id, second best
    logits[:, 5] = 30.0
    greedy = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    hot = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[7])
    out = _sample(logits, [greedy, greedy, hot, hot], num_generated=[0, 2, 1, 2])
    assert out.tolist() == [5, EOS, 5, EOS]
    for seed in range(20):
        gen = make_generator(seed, "cpu")
        row = _sample(logits[:1], [hot], generators=[gen], num_generated=[1])
        assert row.item() not in (EOS, 7)


def test_top_k_one_matches_greedy_at_any_temperature() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 2000, generator=g)  # (B, V)
    params = [SamplingParams(temperature=5.0, top_k=1)] * 32
    gens = [make_generator(i, "cpu") for i in range(32)]
    assert torch.equal(_sample(logits, params, gens), logits.argmax(dim=-1))


def test_tiny_top_p_matches_greedy() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(32, 2000, generator=g)  # (B, V)
    params = [SamplingParams(temperature=2.0, top_p=1e-6)] * 32
    gens = [make_generator(i, "cpu") if i % 2 else None for i in range(32)]
    assert torch.equal(_sample(logits, params, gens), logits.argmax(dim=-1))


def _seeded_run(seed: int, steps: int = 40, batch_noise: bool = False) -> list[int]:
    """Tokens drawn by one seeded request over `steps` steps (optionally in a mixed batch)."""
    gen = make_generator(seed, "cpu")
    logits = torch.linspace(0.0, 1.0, 1000).unsqueeze(0)  # (1, V), nearly flat
    params = SamplingParams(seed=seed, temperature=1.0)
    out = []
    for _ in range(steps):
        if batch_noise:  # the seeded row sits between greedy and unseeded rows
            batch = torch.cat([logits, logits, logits])  # (3, V)
            rows = [SamplingParams(temperature=0.0), params, SamplingParams()]
            out.append(_sample(batch, rows, [None, gen, None])[1].item())
        else:
            out.append(_sample(logits, [params], [gen]).item())
    return out


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    first = _seeded_run(1234)
    assert first == _seeded_run(1234)
    assert first == _seeded_run(1234, batch_noise=True), "seeded rows must ignore the batch"
    assert first != _seeded_run(4321)
    assert len(set(first)) > 10  # it really samples
    assert make_generator(None, "cpu") is None
    assert make_generator(-1, "cpu").initial_seed() == 2**64 - 1


LOGITS6 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])


def _counts_global_rng(params: SamplingParams, draws: int = 24_000) -> torch.Tensor:
    logits = LOGITS6.repeat(2000, 1)  # (B, V)
    counts = torch.zeros(6)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        for _ in range(draws // 2000):
            counts += torch.bincount(_sample(logits, [params] * 2000, eos=()), minlength=6)
    return counts


def _counts_generator(params: SamplingParams, draws: int = 6_000) -> torch.Tensor:
    logits = LOGITS6.repeat(100, 1)  # (B, V)
    gen = make_generator(11, "cpu")
    counts = torch.zeros(6)
    for _ in range(draws // 100):
        counts += torch.bincount(_sample(logits, [params] * 100, [gen] * 100, eos=()), minlength=6)
    return counts


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("counter", [_counts_global_rng, _counts_generator])
def test_temperature_sampling_matches_softmax(temperature: float, counter) -> None:
    counts = counter(SamplingParams(temperature=temperature))
    probs = torch.softmax(LOGITS6 / temperature, dim=0)
    assert _chi_square(counts, probs) < CHI2_DF5_P001


def test_top_k_keeps_k_most_likely_renormalised() -> None:
    counts = _counts_global_rng(SamplingParams(temperature=1.0, top_k=2))
    assert counts[2:].sum() == 0
    share = counts[0] / counts[:2].sum()
    expected = torch.softmax(LOGITS6[:2], dim=0)[0]
    assert abs(share - expected) < 0.02


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.softmax(LOGITS6, dim=0)  # cumulative: .48, .66, .77, .84, ...
    top_p = float(probs[:2].sum()) + 0.01  # needs the third token to reach top_p
    counts = _counts_global_rng(SamplingParams(temperature=1.0, top_p=top_p))
    assert counts[3:].sum() == 0 and (counts[:3] > 0).all()
    share = counts[:3] / counts[:3].sum()
    assert torch.allclose(share, probs[:3] / probs[:3].sum(), atol=0.02)


def test_top_p_applies_after_top_k() -> None:
    # Within the top 2 the first token holds ~73%, so top_p=0.7 keeps only it.
    counts = _counts_global_rng(SamplingParams(temperature=1.0, top_k=2, top_p=0.7), 4000)
    assert counts[0] == 4000


def test_rows_with_no_finite_logit_do_not_crash() -> None:
    logits = torch.full((2, 5), float("-inf"))  # (B, V)
    out = _sample(logits, [SamplingParams(), SamplingParams(temperature=0.0)], eos=())
    assert out.shape == (2,) and ((out >= 0) & (out < 5)).all()


def test_shape_and_length_mismatch_are_errors() -> None:
    with pytest.raises(ValueError):
        _sample(torch.zeros(5), [SamplingParams()])
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [SamplingParams()], [None, None], [0, 0], [])


# -- the same tokens as the full-sort algorithm ---------------------------------------


def _rows_of_every_kind(vocab: int, gen: torch.Generator) -> torch.Tensor:
    """(8, V) logits: model-like, flat, integer ties, bfloat16-rounded (ties), a grammar
    mask (-inf mostly), one NaN, one +inf, all -inf."""
    spread = torch.randn(8, vocab, generator=gen) * 2.5  # (8, V)
    rows = [
        spread[0],
        spread[1] * 0.05,
        torch.randint(0, 4, (vocab,), generator=gen).float(),
        spread[3].bfloat16().float(),
        spread[4].masked_fill(torch.rand(vocab, generator=gen) < 0.97, float("-inf")),
        spread[5].index_fill(0, torch.tensor([7, 11]), float("nan")),
        spread[6].index_fill(0, torch.tensor([3, 5]), float("inf")),
        torch.full((vocab,), float("-inf")),
    ]
    return torch.stack(rows)


def _grid() -> list[SamplingParams]:
    """Temperatures, top-k on both sides of the partial-selection bound, top-p, min-p."""
    return [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
        for t in (0.3, 1.0, 1.7)
        for k in (0, 2, 40, PARTIAL_SELECTION_MAX_K, PARTIAL_SELECTION_MAX_K + 1, 700)
        for p in (1.0, 0.9, 0.3, 1e-6)
        for m in (0.0, 0.1)
    ]


@pytest.mark.parametrize("vocab", [3000, 49_152])
def test_seeded_draws_are_the_full_sort_algorithms(vocab: int) -> None:
    """Every seeded draw picks the token the full sort with ids picks for the same
    uniform: every kind of row under every combination of filters, many seeds each."""
    gen = torch.Generator().manual_seed(vocab)
    grid = _grid() if vocab < 10_000 else _grid()[::23]
    kinds = _rows_of_every_kind(vocab, gen)  # (8, V)
    x = kinds.repeat(len(grid), 1)  # (8 * P, V): every kind under every params
    params = [p for p in grid for _ in range(kinds.shape[0])]
    sampler = Sampler()
    draws = 0
    for step in range(4 if vocab < 10_000 else 2):
        seeds = [step * len(params) + i for i in range(len(params))]
        new = sampler(x, params, [make_generator(s, "cpu") for s in seeds], [0] * len(x), ())
        old = full_sort_inverse_cdf(x, params, [make_generator(s, "cpu") for s in seeds])
        assert torch.equal(new, old), (new != old).nonzero().flatten().tolist()[:10]
        draws += len(params)
    assert draws >= (4000 if vocab < 10_000 else 90)


def test_unseeded_broken_rows_match_the_full_sort_algorithm() -> None:
    """Rows without a distribution (NaN, +inf, all -inf) take the full sort's first token
    whether seeded or not: the lowest NaN id, else the lowest +inf id, else 0."""
    kinds = _rows_of_every_kind(500, torch.Generator().manual_seed(3))[5:]  # (3, V)
    params = [SamplingParams(temperature=0.8)] * 3
    new = sample_rows(kinds, params, [None] * 3)
    assert new.tolist() == [7, 3, 0]
    assert torch.equal(new, full_sort_sample_rows(kinds, params, [None] * 3))


def test_unseeded_rows_keep_the_filtered_distribution() -> None:
    """Unseeded rows draw by inverse CDF from the shared RNG: top-k, top-p and min-p keep
    exactly the tokens the full sort keeps, in the same proportions."""
    logits = torch.tensor([2.0, 1.0, 1.0, 0.5, 0.0, -0.5])  # a tie at ids 1 and 2
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)  # keeps ids 0, 1, 2
    x = logits.repeat(20_000, 1)  # (N, V)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        counts = torch.bincount(sample_rows(x, [params] * 20_000, [None] * 20_000), minlength=6)
    assert counts[3:].sum() == 0
    expected = torch.softmax(logits[:3], dim=0)
    assert _chi_square(counts[:3].float(), expected) < CHI2_DF5_P001


def test_seeded_rows_keep_the_filtered_distribution() -> None:
    """A seeded row draws one uniform from its own generator: over many seeds, the
    tokens top-k and top-p keep come out in their renormalised proportions."""
    logits = torch.tensor([2.0, 1.0, 1.0, 0.5, 0.0, -0.5])  # a tie at ids 1 and 2
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)  # keeps ids 0, 1, 2
    draws = 20_000
    gens = [make_generator(seed, "cpu") for seed in range(draws)]
    counts = torch.bincount(
        sample_rows(logits.repeat(draws, 1), [params] * draws, gens), minlength=6
    )
    assert counts[3:].sum() == 0
    assert _chi_square(counts[:3].float(), torch.softmax(logits[:3], dim=0)) < CHI2_DF5_P001


def test_a_greedy_batch_with_nothing_to_mask_is_the_argmax_and_a_ban_still_applies():
    """All rows greedy, nothing masking: the argmax of the logits (ties to the lowest id,
    bfloat16 logits read as float32); one row still under its min_tokens bans EOS."""
    logits = torch.randn(4, 50).bfloat16()
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the lowest id wins
    logits[2, EOS] = logits[2].max() + 1  # EOS leads row 2
    greedy = [SamplingParams(temperature=0.0)] * 4
    expected = logits.float().argmax(dim=-1)
    assert expected[1] == 7 and expected[2] == EOS
    assert torch.equal(_sample(logits, greedy), expected)
    banned = [SamplingParams(temperature=0.0, min_tokens=2 if i == 2 else 0) for i in range(4)]
    out = _sample(logits, banned, num_generated=[0, 0, 1, 0])
    assert out[2] != EOS and torch.equal(out[[0, 1, 3]], expected[[0, 1, 3]])
    biased = [SamplingParams(temperature=0.0, logit_bias={5: 100.0})] * 4
    assert (_sample(logits, biased) == 5).all()
