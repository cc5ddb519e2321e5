"""What the engine hands back: per-step deltas and whole-request results."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one request from one engine step (streaming unit)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    host_cached_tokens: int = 0  # of cached_tokens, those loaded from the host tier


@dataclass(frozen=True)
class GenerationResult:
    """A finished request."""

    request_id: str
    text: str
    token_ids: list[int]  # generated tokens only
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    computed_prompt_tokens: int  # prompt tokens that ran through the model
    finish_reason: str
    ttft_ms: float
    e2e_ms: float
