"""Which tokens a perplexity run scores, by llama.cpp's rule, and the estimate from them.

llama.cpp's ``llama-perplexity`` (``tools/perplexity/perplexity.cpp``, function
``perplexity``, without ``--ppl-stride``) does this, and so does `plan_chunks`:

- the text is tokenised once, with the model's special tokens (a BOS first only if the
  GGUF's ``tokenizer.ggml.add_bos_token`` says so); ``-f`` drops one trailing newline
  of the file first (`scored_text`);
- it needs at least ``2 * ctx`` tokens; the chunks are ``tokens[i*ctx:(i+1)*ctx]`` for
  ``i < len(tokens) // ctx`` (the tail that fills no chunk is never read), at most
  ``--chunks`` of them;
- each chunk is evaluated alone (KV cache cleared), and when the model adds a BOS its
  first token is replaced by the BOS;
- with ``first = ctx // 2``, the logits of positions ``first .. ctx-2`` score the tokens
  at ``first+1 .. ctx-1``: ``ctx - first - 1`` tokens per chunk (255 of 512), so every
  scored token has at least half a window of context;
- perplexity is ``exp`` of the mean negative log-likelihood over all scored tokens, and
  its uncertainty ``ppl * sqrt((mean(nll²) - mean(nll)²) / (count - 1))``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.engine.outputs import NEG_INF_LOGPROB, TokenLogprob
from radixserve.errors import RequestError


def scored_text(file_text: str) -> str:
    """The text llama-perplexity reads from a file: one trailing newline dropped."""
    return file_text[:-1] if file_text.endswith("\n") else file_text


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks one perplexity run evaluates and the positions it scores in each."""

    ctx: int
    chunks: tuple[tuple[int, ...], ...]  # each ctx tokens, BOS first where the model adds one

    @property
    def first(self) -> int:
        """Position whose logits score the first scored token (at ``first + 1``)."""
        return self.ctx // 2

    @property
    def scored_per_chunk(self) -> int:
        return self.ctx - self.first - 1

    @property
    def num_scored(self) -> int:
        return self.scored_per_chunk * len(self.chunks)


def check_sizes(ctx: int, max_chunks: int | None) -> None:
    if ctx < 4:
        raise RequestError(f"--ctx must be at least 4, not {ctx}")
    if max_chunks is not None and max_chunks < 1:
        raise RequestError(f"--chunks must be at least 1, not {max_chunks}")


def plan_chunks(
    tokens: Sequence[int], ctx: int, bos_token_id: int | None, max_chunks: int | None = None
) -> ChunkPlan:
    """The chunks of ``tokens`` (the whole text, tokenised with special tokens);
    ``bos_token_id`` only when the model adds a BOS (it then opens every chunk)."""
    check_sizes(ctx, max_chunks)
    if len(tokens) < 2 * ctx:
        raise RequestError(f"the text has {len(tokens)} tokens; a context of {ctx} needs at "
                           f"least {2 * ctx} (two chunks)")  # fmt: skip
    count = len(tokens) // ctx
    if max_chunks is not None:
        count = min(count, max_chunks)
    chunks = []
    for i in range(count):
        chunk = list(tokens[i * ctx : (i + 1) * ctx])
        if bos_token_id is not None:
            chunk[0] = bos_token_id
        chunks.append(tuple(chunk))
    return ChunkPlan(ctx, tuple(chunks))


def scored_nlls(
    plan: ChunkPlan, chunk: int, prompt_logprobs: Sequence[TokenLogprob]
) -> list[float]:
    """Negative log-likelihoods of the scored tokens of chunk ``chunk``, from the engine's
    prompt log-probabilities of it (entry k: token k+1 given tokens 0..k)."""
    tokens = plan.chunks[chunk]
    if len(prompt_logprobs) != plan.ctx - 1:
        raise ValueError(f"chunk {chunk}: {len(prompt_logprobs)} prompt log-probabilities, "
                         f"expected {plan.ctx - 1}")  # fmt: skip
    out = []
    for k in range(plan.first, plan.ctx - 1):
        entry = prompt_logprobs[k]
        if entry.token_id != tokens[k + 1]:
            raise ValueError(f"chunk {chunk}: log-probability {k} is of token {entry.token_id}, "
                             f"not {tokens[k + 1]}")  # fmt: skip
        out.append(math.inf if entry.logprob <= NEG_INF_LOGPROB else -entry.logprob)
    return out


@dataclass(frozen=True)
class Estimate:
    """Perplexity over ``count`` scored tokens, with llama.cpp's uncertainty."""

    ppl: float
    uncertainty: float
    mean_nll: float
    count: int


def estimate(nlls: Sequence[float]) -> Estimate:
    count = len(nlls)
    if count < 2:
        raise ValueError("a perplexity estimate needs at least two scored tokens")
    mean = math.fsum(nlls) / count
    if not math.isfinite(mean):  # a token the model gave probability 0
        return Estimate(math.inf, math.inf, mean, count)
    ppl = math.exp(mean)
    variance = math.fsum(v * v for v in nlls) / count - mean * mean
    spread = math.sqrt(variance / (count - 1)) if variance > 0 else 0.0
    return Estimate(ppl, ppl * spread, mean, count)
