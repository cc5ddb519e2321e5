"""What one rank of a worker holds: its shard of the model and of the KV pool.

Without tensor parallelism the worker's one rank holds all of both. With it
(`radixserve.engine.tp_group`), rank 0 (the worker's own process, which also runs the
scheduler, the radix cache and the page allocator) and every rank process build their
shard here, from the same settings, so that they agree on every shape and on the number
of KV pages (page ids mean the same on every rank).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.model.attention import AttentionBackend, make_attention_backend
from radixserve.model.checkpoint import Checkpoint
from radixserve.model.layout import Plan, checkpoint_schemes, quant_targets
from radixserve.model.llama import LlamaModel
from radixserve.model.quant import plan_schemes
from radixserve.model.tp import TPComm, TPShard
from radixserve.settings import EngineSettings
from radixserve.transfer.shards import KVShard

T = TypeVar("T")


@dataclass
class ModelShard:
    model: LlamaModel
    plan: Plan
    attention: AttentionBackend
    kv_pool: KVPool
    kv_shard: KVShard  # the model's KV heads this rank's pool holds

    @classmethod
    def build(
        cls,
        settings: EngineSettings,
        checkpoint: Checkpoint,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        tp: TPShard,
        comm: TPComm | None,
        pace: Callable[[Iterator[T]], Iterator[T]] = lambda items: items,
    ) -> ModelShard:
        """Rank ``tp``'s model (weights loaded; ``pace`` wraps their iterator) and KV pool
        (``settings.kv_cache_memory_gib`` of this rank's heads' pages)."""
        config = checkpoint.config
        attention = make_attention_backend(settings.attention_backend, device)
        plan = plan_schemes(
            settings.quantization, device, quant_targets(config, tp), checkpoint.formats()
        )
        model = LlamaModel(
            config, dtype, device, max_positions=max_model_len, attention=attention,
            ops=attention.ops, plan=plan, tp=tp, comm=comm,
        )  # fmt: skip
        weights = checkpoint.iter_weights(dtype, checkpoint_schemes(config, plan))
        model.load_weights(pace(weights))  # type: ignore[arg-type]
        budget = int(settings.kv_cache_memory_gib * (1 << 30))
        num_pages = KVPool.num_pages_for_budget(config, settings.page_size, dtype, budget, tp)
        kv_pool = KVPool.from_config(config, settings.page_size, num_pages, dtype, device, tp)
        kv_shard = KVShard(tp.size, tp.rank, tp.kv_head_start(config), tp.kv_heads(config))
        return cls(model, plan, attention, kv_pool, kv_shard)


def copy_page(kv_pool: KVPool, src: int, dst: int) -> None:
    """Page ``dst`` becomes a copy of page ``src`` (every layer, K and V)."""
    kv = kv_pool.kv  # (L, 2, P, page_size, H, D)
    kv[:, :, dst].copy_(kv[:, :, src])


def copy_out(kv_pool: KVPool, shard: KVShard, page_ids: list[int], buffer: torch.Tensor,
             slots: list[int]) -> None:  # fmt: skip
    """Pages ``page_ids`` into ``slots`` of ``buffer``, a host tensor of whole pages (L, 2,
    N, page_size, every KV head, D): this rank's heads of them."""
    kv = kv_pool.kv
    pages = kv.index_select(2, torch.tensor(page_ids, device=kv.device)).to("cpu")
    dst = torch.tensor(slots)
    if shard.count == buffer.shape[4]:
        buffer.index_copy_(2, dst, pages)
    else:
        buffer[:, :, dst, :, shard.first : shard.first + shard.count] = pages


def describe_plan(plan: Mapping[str, str]) -> str:
    """ "int4" when every matrix is int4, else e.g. "int4 (embed int8)"."""
    counts = collections.Counter(plan.values())
    if not counts:
        return "none"
    main = max(counts, key=lambda s: counts[s])
    others = sorted(f"{key} {s}" for key, s in plan.items() if s != main)
    if len(others) > 3:
        others = [f"{n} {s}" for s, n in counts.items() if s != main]
    return main + (f" ({', '.join(others)})" if others else "")
