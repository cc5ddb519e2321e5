"""What services may know of an engine, as immutable values: `EngineInfo` (what it
serves, fixed at start) and `EngineStats` (its counters, taken on the engine thread
after every step and every call, so reading them from the event loop never races a
step). `AsyncEngine` exposes both; nothing outside the engine package reads the
engine, its scheduler or its KV pool directly."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from radixserve.model.identity import ModelIdentity
from radixserve.model.model_files import served_model_id
from radixserve.transfer.compat import PoolCompat
from radixserve.transfer.shards import KVShard

if TYPE_CHECKING:
    import torch

    from radixserve.engine.engine import Engine
    from radixserve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves. ``identity`` names the weights, quantization, dtype and
    adapter that compute its pages (`ModelIdentity`, part of ``hash_namespace`` and of
    ``geometry``); ``geometry`` is the page geometry peers must share (checked
    at every handshake); ``kv`` the pool's memory, (L, 2, P, page_size, H, D), which
    transfer agents register (rank 0's heads of it, ``kv_shard``, with tensor
    parallelism: ``kv_shard.size`` ranks)."""

    model_name: str
    served_name: str
    max_model_len: int
    vocab_size: int
    page_size: int
    prefix_cache: bool
    hash_namespace: bytes  # the radix cache's page-hash namespace (identity and cache salt)
    geometry: PoolCompat
    kv_shard: KVShard  # the KV heads ``kv`` holds (rank 0's, with tensor parallelism)
    kv: torch.Tensor = field(repr=False)
    tokenizer: Tokenizer = field(repr=False)
    identity: ModelIdentity | None = None  # what computed its pages (None: not stated)

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        return cls(
            model_name=engine.config.name,
            served_name=served_model_id(engine.settings.model),
            max_model_len=engine.max_model_len,
            vocab_size=engine.config.vocab_size,
            page_size=engine.page_size,
            prefix_cache=engine.cache is not None,
            hash_namespace=engine.namespace,
            geometry=PoolCompat.of(
                engine.kv_pool.kv,
                engine.config.name,
                engine.config.num_kv_heads,
                engine.identity.digest,
            ),
            kv_shard=engine.kv_shard,
            kv=engine.kv_pool.kv,
            tokenizer=engine.tokenizer,
            identity=engine.identity,
        )


@dataclass(frozen=True)
class EngineStats:
    """An engine's counters at one moment: pool pages (`Engine.cache_stats`), step
    counters (`StepStats`), the running and waiting requests, the prompt tokens queued
    and not computed, the page leases held, and the LoRA adapter slots (``lora``: the
    adapters resident and the slots, copies into a slot and evictions from one, the
    waiting requests whose adapter finds no slot)."""

    cache: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    steps: Mapping[str, int | float] = field(default_factory=lambda: MappingProxyType({}))
    running: int = 0
    waiting: int = 0
    queued_prompt_tokens: int = 0
    leases: int = 0
    # the LoRA adapter slots, named as the heartbeat's fields (`EngineSection.lora_*`)
    lora: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # each loaded adapter's (slot loads, evictions), by name (`LoraManager.counts`)
    lora_counts: Mapping[str, tuple[int, int]] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, engine: Engine) -> EngineStats:
        cache = engine.cache_stats()
        return cls(
            cache=MappingProxyType(cache),
            steps=MappingProxyType(
                {**engine.step_stats.as_dict(), **engine.speculator.counters()}
            ),  # fmt: skip
            running=len(engine.scheduler.running),
            waiting=len(engine.scheduler.waiting),
            queued_prompt_tokens=engine.step_stats.queued_prompt_tokens,
            leases=cache["leases"],
            lora=MappingProxyType(
                {
                    "lora_resident": len(engine.loras.resident),
                    "lora_max": engine.loras.max_loras,
                    "lora_loads_total": engine.loras.num_loads,
                    "lora_evictions_total": engine.loras.num_evictions,
                    "lora_waiting_requests": engine.scheduler.num_waiting_for_adapter(),
                }
            ),
            lora_counts=MappingProxyType(engine.loras.counts()),
        )

    @property
    def prefill_tokens_per_s(self) -> float:
        """The measured prefill rate: prompt tokens computed per second of the steps'
        prefill share (0 before the first prefill)."""
        seconds = self.steps.get("engine_prefill_seconds_total", 0.0)
        return self.steps.get("engine_prefill_tokens_total", 0) / seconds if seconds > 0 else 0.0
