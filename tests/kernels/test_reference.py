"""The torch reference kernels (the specification) against naive per-token loops in
float64, on poisoned pools: the reference never reads a slot a sequence does not own."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.kernels import reference as ref
from tests.kernels.paged import PagedBatch, index, make_paged_batch, randn

CPU = torch.device("cpu")


def _naive_attention(q: torch.Tensor, batch: PagedBatch, b: int, visible: int) -> torch.Tensor:
    """One query token (H, D) of sequence b over its positions 0..visible-1, key by key."""
    heads, dim = q.shape
    group = heads // batch.k_cache.shape[2]
    out = torch.zeros((heads, dim), dtype=torch.float64)
    for h in range(heads):
        slots = [batch.slot(b, p) for p in range(visible)]
        flat_k = batch.k_cache.flatten(0, 1).double()
        flat_v = batch.v_cache.flatten(0, 1).double()
        scores = [float(q[h].double() @ flat_k[s, h // group]) / math.sqrt(dim) for s in slots]
        top = max(scores)
        weights = [math.exp(x - top) for x in scores]
        for w, s in zip(weights, slots):
            out[h] += w / sum(weights) * flat_v[s, h // group]
    return out


@pytest.mark.parametrize("page_size,group", [(1, 1), (4, 3), (16, 8)])
def test_extend_reference_matches_naive_loop(page_size, group):
    # (prefix, new): no prefix; a prefix ending mid-page; one new token; a long run
    spans = [(0, 5), (page_size + 3, 4), (7, 1), (2 * page_size, page_size + 2)]
    batch = make_paged_batch([p + n for p, n in spans], page_size, 2, 8, torch.float32, CPU)
    tokens = sum(n for _, n in spans)
    q = randn((tokens, 2 * group, 8), torch.float32, CPU, seed=1)
    cu = [0]
    for _, n in spans:
        cu.append(cu[-1] + n)
    out = ref.extend_attention(
        q, batch.k_cache, batch.v_cache, index(cu, CPU), index([p for p, _ in spans], CPU),
        batch.page_table, max(n for _, n in spans),
    )  # fmt: skip
    for b, (prefix, n) in enumerate(spans):
        for i in range(n):
            want = _naive_attention(q[cu[b] + i], batch, b, prefix + i + 1)
            torch.testing.assert_close(out[cu[b] + i].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size,group", [(1, 8), (4, 1), (16, 3)])
def test_decode_reference_matches_naive_loop(page_size, group):
    seq_lens = [1, page_size + 3, 3 * page_size, 11, 0]  # the last is a padding row
    batch = make_paged_batch(seq_lens, page_size, 2, 8, torch.float32, CPU)
    q = randn((len(seq_lens), 2 * group, 8), torch.float32, CPU, seed=2)
    out = ref.decode_attention(
        q, batch.k_cache, batch.v_cache, batch.page_table, index(seq_lens, CPU)
    )
    for b, n in enumerate(seq_lens):
        want = _naive_attention(q[b], batch, b, n) if n else torch.zeros(q.shape[1:]).double()
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


def test_store_kv_writes_exactly_its_slots():
    k_cache = torch.full((5, 4, 2, 3), float("nan"))
    v_cache = torch.full((5, 4, 2, 3), float("nan"))
    k, v = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    ref.store_kv(k_cache, v_cache, index([9, -1, 0, 19], CPU), k, v)
    for t, slot in ((0, 9), (2, 0), (3, 19)):
        assert torch.equal(k_cache.flatten(0, 1)[slot], k[t])
        assert torch.equal(v_cache.flatten(0, 1)[slot], v[t])
    assert int((~torch.isnan(k_cache)).sum()) == 3 * 2 * 3  # nothing else written


def test_pack_and_unpack_pages_move_whole_pages_of_every_layer():
    kv = torch.randn(3, 2, 6, 4, 2, 5)
    packed = ref.pack_pages(kv, index([4, 0, 2], CPU))
    for layer in range(3):
        for kind in range(2):
            for n, page in enumerate((4, 0, 2)):
                assert torch.equal(packed[layer, kind, n], kv[layer, kind, page])
    into = torch.zeros_like(kv)
    ref.unpack_pages(into, index([1, 5, 3], CPU), packed)
    assert torch.equal(into[:, :, [1, 5, 3]], packed)
    assert not into[:, :, [0, 2, 4]].any()


def test_rmsnorm_adds_the_residual_then_normalises_each_row():
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    out, total = ref.rmsnorm(x, w, 1e-6, r)
    for row in range(3):
        s = [float(a) + float(b) for a, b in zip(x[row], r[row])]
        rms = math.sqrt(sum(e * e for e in s) / 8 + 1e-6)
        torch.testing.assert_close(out[row], torch.tensor([w[i] * s[i] / rms for i in range(8)]))
        torch.testing.assert_close(total[row], torch.tensor(s))
    alone, same = ref.rmsnorm(x, w, 1e-6)
    assert same is x
    torch.testing.assert_close(alone[0], w * x[0] / x[0].pow(2).mean().add(1e-6).sqrt())


def test_rope_rotates_each_pair_by_its_position_in_place():
    q, k = torch.randn(2, 3, 6), torch.randn(2, 1, 6)
    angles = torch.rand(10, 3) * 6
    q0, k0 = q.clone(), k.clone()
    ref.rope(q, k, index([7, 2], CPU), angles.cos(), angles.sin())
    for x0, x in ((q0, q), (k0, k)):
        for t, pos in enumerate((7, 2)):
            for h in range(x.shape[1]):
                for i in range(3):
                    a, b, th = float(x0[t, h, i]), float(x0[t, h, i + 3]), float(angles[pos, i])
                    want = (
                        a * math.cos(th) - b * math.sin(th),
                        b * math.cos(th) + a * math.sin(th),
                    )
                    got = (float(x[t, h, i]), float(x[t, h, i + 3]))
                    assert got == pytest.approx(want, abs=1e-5)


def test_silu_and_mul_is_gate_times_sigmoid_gate_times_up():
    x = torch.randn(2, 6)
    out = ref.silu_and_mul(x)
    for t in range(2):
        for i in range(3):
            g, u = float(x[t, i]), float(x[t, i + 3])
            assert float(out[t, i]) == pytest.approx(g / (1 + math.exp(-g)) * u, abs=1e-6)
