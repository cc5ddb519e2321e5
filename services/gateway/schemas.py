"""Wire formats of the OpenAI-compatible API: request models and response builders.

Request models validate strictly (a JSON ``true`` is not an integer, ``"1"`` is not a
number) and ignore unknown fields, since benchmark clients send many. Range checks are
left to `SamplingParams`, which raises `InvalidRequestError` (HTTP 400) naming the field.
Unsupported features (n > 1, best_of > 1, echo, logprobs, several prompts) raise
`OpenAIError(400)` rather than being silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from radixserve.engine.outputs import RequestOutput
from radixserve.engine.sampling_params import SamplingParams
from radixserve.services.gateway.errors import OpenAIError

Prompt = str | list[int] | list[str] | list[list[int]]


class StreamOptions(BaseModel):
    """`stream_options`: only include_usage is honoured."""

    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool | None = False


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _check_supported(self) -> None:
        if self.n not in (None, 1):
            raise OpenAIError(400, f"only n=1 is supported, got {self.n}", "n")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Engine parameters; `max_tokens` is the resolved limit. Raises on bad values."""
        self._check_supported()
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=0 if self.min_tokens is None else self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=() if self.stop is None else self.stop,  # type: ignore[arg-type]
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
        )


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`. max_tokens defaults to 16 (as OpenAI's)."""

    prompt: Prompt
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); a list of exactly one is unwrapped."""
        if self.best_of not in (None, 1):
            raise OpenAIError(400, f"only best_of=1 is supported, got {self.best_of}", "best_of")
        if self.echo:
            raise OpenAIError(400, "echo is not supported", "echo")
        if self.logprobs is not None:
            raise OpenAIError(400, "logprobs are not supported", "logprobs")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise OpenAIError(400, "exactly one prompt per request is supported", "prompt")
            prompt = prompt[0]  # type: ignore[assignment]
        if not prompt:
            raise OpenAIError(400, "prompt is empty", "prompt")
        return prompt  # type: ignore[return-value]


class ChatCompletionRequest(_GenerationRequest):
    """`POST /v1/chat/completions`. max_completion_tokens wins over max_tokens."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False

    def check_supported(self) -> None:
        if self.logprobs:
            raise OpenAIError(400, "logprobs are not supported", "logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


def usage(out: RequestOutput) -> dict[str, Any]:
    """OpenAI `usage` from a request's last output."""
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


Kind = Literal["completion", "chat"]


def _envelope(kind: Kind, rid: str, created: int, model: str, stream: bool) -> dict[str, Any]:
    if kind == "completion":
        obj = "text_completion"
    else:
        obj = "chat.completion.chunk" if stream else "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": model}


def full_response(
    kind: Kind, rid: str, created: int, model: str, text: str, last: RequestOutput
) -> dict[str, Any]:
    """A non-streaming response holding the whole `text`."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
    if kind == "completion":
        choice["text"] = text
    else:
        choice["message"] = {"role": "assistant", "content": text}
    body = _envelope(kind, rid, created, model, stream=False)
    body.update(choices=[choice], usage=usage(last))
    return body


def stream_chunk(
    kind: Kind,
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any] | str,
    finish_reason: str | None,
    with_usage_field: bool,
) -> dict[str, Any]:
    """One SSE chunk; `delta` is the text (completion) or the delta dict (chat)."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    choice["text" if kind == "completion" else "delta"] = delta
    body = _envelope(kind, rid, created, model, stream=True)
    body["choices"] = [choice]
    if with_usage_field:
        body["usage"] = None
    return body


def usage_chunk(kind: Kind, rid: str, created: int, model: str, last: RequestOutput) -> dict:
    """The final `stream_options.include_usage` chunk: empty choices, filled usage."""
    body = _envelope(kind, rid, created, model, stream=True)
    body.update(choices=[], usage=usage(last))
    return body
