"""The fused mixture-of-experts MLP: the reference against the definition (a loop over
tokens and their experts), and the Triton kernel against the reference, over ragged
expert loads (an expert with no tokens, one that every token picks, one-token experts)
in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels import reference as ref
from tests.kernels.conftest import TRITON

HIDDEN, INTER, EXPERTS = 64, 48, 6


def _weights(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn((EXPERTS, 2 * INTER, HIDDEN), generator=g) / HIDDEN**0.5
    down = torch.randn((EXPERTS, HIDDEN, INTER), generator=g) / INTER**0.5
    return gate_up.to(dtype).to(device), down.to(dtype).to(device)


def _routing(tokens: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token picks expert 0 (all of them), never expert 5 (none), and top_k - 1
    others among 1..4; weights from a softmax."""
    g = torch.Generator().manual_seed(tokens)
    others = torch.stack([torch.randperm(4, generator=g)[: top_k - 1] + 1 for _ in range(tokens)])
    ids = torch.cat([torch.zeros((tokens, 1), dtype=torch.int64), others], dim=1)
    weights = torch.softmax(torch.randn((tokens, top_k), generator=g), dim=-1)
    return ids.to(device), weights.to(device)


def _definition(x, w_gate_up, w_down, ids, weights) -> torch.Tensor:
    out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = x[t].float() @ w_gate_up[e].float().T
            y = (F.silu(h[:INTER]) * h[INTER:]) @ w_down[e].float().T
            out[t] += weights[t, k].float() * y
    return out


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (7, 2), (33, 3)])
def test_the_reference_is_the_definition(tokens, top_k):
    w_gate_up, w_down = _weights(torch.float32, torch.device("cpu"))
    x = torch.randn((tokens, HIDDEN), generator=torch.Generator().manual_seed(1))
    ids, weights = _routing(tokens, top_k, torch.device("cpu"))
    torch.testing.assert_close(ref.fused_moe(x, w_gate_up, w_down, ids, weights),
                               _definition(x, w_gate_up, w_down, ids, weights),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (17, 2), (40, 3)])
def test_triton_equals_the_reference(device, dtype, tokens, top_k):
    w_gate_up, w_down = _weights(dtype, device)
    x = torch.randn((tokens, HIDDEN), generator=torch.Generator().manual_seed(2)).to(dtype)
    x = x.to(device)
    ids, weights = _routing(tokens, top_k, device)
    want = ref.fused_moe(x, w_gate_up, w_down, ids, weights)
    got = TRITON.fused_moe(x, w_gate_up, w_down, ids, weights)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert got.dtype == dtype and got.shape == (tokens, HIDDEN)


def test_triton_refuses_mismatched_experts(device):
    w_gate_up, w_down = _weights(torch.float32, device)
    x = torch.randn((3, HIDDEN)).to(device)
    ids, weights = _routing(3, 2, device)
    with pytest.raises(ValueError, match="w_down has shape"):
        TRITON.fused_moe(x, w_gate_up, w_down[:, :, :8], ids, weights)
