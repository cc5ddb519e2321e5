"""Penalties and logit biases change the logits as their definitions say: the batched
device form against a direct per-token formula, and through the sampler."""

from __future__ import annotations

import torch

from radixserve.engine.penalties import apply_logit_bias, apply_penalties
from radixserve.engine.sampler import Sampler
from radixserve.engine.sampling_params import SamplingParams

V = 50


def _direct(logits: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int]):
    """The definitions, one token at a time (vLLM's repetition; OpenAI's frequency and
    presence; then biases)."""
    x = logits.clone()
    for t in range(V):
        if t in prompt or t in out:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        count = out.count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    for t, bias in p.logit_bias:
        x[t] += bias
    return x


def test_batched_penalties_equal_the_direct_formula():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g) * 3  # (B, V)
    params = [
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(),  # untouched
        SamplingParams(repetition_penalty=1.8, logit_bias={3: 5.0, 7: -100.0}),
        SamplingParams(repetition_penalty=0.5, frequency_penalty=-2.0, presence_penalty=2.0),
        SamplingParams(logit_bias={0: 1.5}),
    ]
    prompts = [[1, 2, 3], [4], [5, 6, 5, 9], [10, 11], []]
    outputs = [[2, 2, 8, 40], [4, 4], [6, 6, 6, 12], [], [49, 49]]
    x = logits.clone()
    apply_penalties(x, params, prompts, outputs)
    apply_logit_bias(x, params)
    for row in range(5):
        expected = _direct(logits[row], params[row], prompts[row], outputs[row])
        torch.testing.assert_close(x[row], expected)
    torch.testing.assert_close(x[1], logits[1])


def test_sampler_picks_by_the_penalised_logits():
    logits = torch.zeros(3, V)
    logits[:, 10] = 3.0  # best, but already generated twice
    logits[:, 11] = 2.0
    logits[:, 12] = 1.5
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.6),  # 3 - 1.2 = 1.8 < 2
        SamplingParams(temperature=0.0, presence_penalty=0.9),  # 3 - 0.9 = 2.1 > 2
        SamplingParams(temperature=0.0, logit_bias={12: 2.0}),  # 1.5 + 2 = 3.5
    ]
    outs = [[10, 10]] * 3
    got = Sampler()(logits, params, [None] * 3, [2] * 3, (), prompt_ids=[[]] * 3,
                    output_ids=outs)  # fmt: skip
    assert got.tolist() == [11, 10, 12]


def test_sampled_distribution_follows_the_penalised_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = SamplingParams(temperature=0.5, frequency_penalty=1.0, repetition_penalty=1.5, seed=3)
    prompt, out = [1], [0, 0]
    penalised = _direct(torch.cat([logits[0], torch.full((V - 4,), -1e9)]), p, prompt, out)
    expected = torch.softmax(penalised[:4] / 0.5, dim=-1)
    sampler = Sampler()
    draws = torch.zeros(4)
    for i in range(4000):
        gen = torch.Generator().manual_seed(i)
        x = torch.cat([logits, torch.full((1, V - 4), -1e9)], dim=1)
        tok = sampler(x, [p], [gen], [2], (), prompt_ids=[prompt], output_ids=[out])
        draws[int(tok)] += 1
    chi2 = float(((draws - 4000 * expected) ** 2 / (4000 * expected)).sum())
    assert chi2 < 16.27, (draws, expected)  # 3 degrees of freedom, p = 0.001


def test_a_top_p_that_underflows_float32_keeps_the_best_token():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    p = SamplingParams(temperature=1.0, top_p=5e-324, min_p=0.5, seed=1)
    gen = torch.Generator().manual_seed(0)
    assert Sampler()(logits, [p], [gen], [0], ()).tolist() == [1]
