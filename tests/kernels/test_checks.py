"""Each Triton op refuses bad arguments before launching, naming the argument."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import TRITON
from tests.kernels.paged import index


@pytest.fixture
def caches(device):
    return torch.zeros(4, 4, 2, 16, device=device), torch.zeros(4, 4, 2, 16, device=device)


def test_store_kv_checks(device, caches):
    k = torch.zeros(3, 2, 16, device=device)
    with pytest.raises(ValueError, match="slot_mapping has dtype torch.float32"):
        TRITON.store_kv(*caches, torch.zeros(3, device=device), k, k)
    with pytest.raises(ValueError, match=r"k has shape \(3, 2, 16\), expected \(2, 2, 16\)"):
        TRITON.store_kv(*caches, index([0, 1], device), k, k[:2])
    with pytest.raises(ValueError, match="dtypes differ"):
        TRITON.store_kv(*caches, index([0, 1, 2], device), k, k.half())
    with pytest.raises(ValueError, match="k_cache must be contiguous within the layer"):
        TRITON.store_kv(caches[0].transpose(0, 1), caches[1], index([0, 1, 2], device), k, k)


def test_attention_checks(device, caches):
    q = torch.zeros(2, 6, 16, device=device)
    table, lens = index([[1, 2], [3, 0]], device), index([5, 2], device)
    with pytest.raises(ValueError, match="q needs a unit stride"):
        TRITON.decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), *caches, table,
                                lens)  # fmt: skip
    with pytest.raises(ValueError, match="5 q heads are not a multiple of 2 kv heads"):
        TRITON.decode_attention(q[:, :5], *caches, table, lens)
    with pytest.raises(ValueError, match="num_splits 65 is outside"):
        TRITON.decode_attention(q, *caches, table, lens, 65)
    with pytest.raises(ValueError, match=r"seq_lens has shape \(1,\)"):
        TRITON.decode_attention(q, *caches, table, lens[:1])
    with pytest.raises(ValueError, match=r"cu_seqlens_q has shape \(2,\), expected \(3,\)"):
        TRITON.extend_attention(q, *caches, index([0, 2], device), lens, table, 2)
    with pytest.raises(ValueError, match="do not match q's head_dim 8"):
        TRITON.extend_attention(q[..., :8], *caches, index([0, 1, 2], device), lens, table, 1)


def test_elementwise_checks(device):
    x = torch.zeros(3, 8, device=device)
    with pytest.raises(ValueError, match=r"weight has shape \(4,\), expected \(8,\)"):
        TRITON.rmsnorm(x, torch.zeros(4, device=device), 1e-6)
    with pytest.raises(ValueError, match="odd|even number"):
        TRITON.silu_and_mul(torch.zeros(3, 7, device=device))
    q, k = torch.zeros(3, 2, 8, device=device), torch.zeros(3, 1, 8, device=device)
    with pytest.raises(ValueError, match="cos has dtype torch.float16"):
        table = torch.zeros(9, 4, device=device)
        TRITON.rope(q, k, index([0, 1, 2], device), table.half(), table)
    kv = torch.zeros(2, 2, 4, 4, 1, 8, device=device)
    with pytest.raises(ValueError, match="packed has shape"):
        TRITON.unpack_pages(kv, index([0, 1], device), torch.zeros(2, 2, 3, 4, 1, 8, device=device))
