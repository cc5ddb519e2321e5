"""The fused-MoE section of the kernels' benchmark (`radixserve.kernels.bench`): the
Triton kernel against the torch reference at a Qwen3-30B-A3B-like layer (128 experts,
top-8, hidden 2048, expert intermediate 768), routed uniformly at random, at a decode
batch and a prefill chunk; tiny shapes in ``--dry-run``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEShape:
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: tuple[int, ...]  # a decode batch, a prefill chunk


FULL = MoEShape(128, 8, 2048, 768, (32, 2048))
DRY = MoEShape(4, 2, 32, 16, (5,))


def moe_cases(run, ops, ref) -> list[dict]:
    """A `bench.Case`'s fields per token count: the fused-MoE layer, its weights read
    once (bytes) and its FLOPs (3 matmuls per routed token)."""
    s = DRY if run.device.type == "cpu" else FULL
    e, k, h, i = s.experts, s.top_k, s.hidden, s.inter
    gen = torch.Generator(device=run.device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        x = torch.randn(shape, generator=gen, device=run.device)
        return (x / shape[-1] ** 0.5).to(run.dtype)

    w_gate_up, w_down = rand(e, 2 * i, h), rand(e, h, i)
    cases = []
    for t in s.tokens:
        x = rand(t, h)
        ids = torch.rand((t, e), generator=gen, device=run.device).topk(k, dim=-1).indices
        weights = torch.softmax(torch.rand((t, k), generator=gen, device=run.device), -1)
        args = (x, w_gate_up, w_down, ids, weights)
        cases.append(dict(
            section="fused_moe", name=f"{t} tokens, {e} experts top-{k}",
            triton=lambda args=args: ops.fused_moe(*args),
            reference=lambda args=args: ref.fused_moe(*args),
            nbytes=(w_gate_up.numel() + w_down.numel()) * w_down.element_size(),
            flops=2.0 * t * k * 3 * h * i, extra={"tokens": t, "experts": e, "top_k": k},
        ))  # fmt: skip
    return cases
