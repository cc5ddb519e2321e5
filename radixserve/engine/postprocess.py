"""After a step: a sampled token appended to its request (its stop conditions checked),
and what a caller sees of a request (`request_output` as it goes, `generation_result`
when it is done)."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.engine.outputs import GenerationResult, RequestOutput, TokenLogprob
from radixserve.engine.request import Request, RequestStatus
from radixserve.engine.structured import advance


def append_token(
    req: Request,
    token: int,
    now: float,
    logprob: TokenLogprob | None,
    eos_token_ids: Sequence[int],
    max_model_len: int,
) -> tuple[str, str | None]:
    """Add a sampled ``token`` to ``req``: (its text, the finish reason or None). A
    finishing request has its text flushed and its finish time set; the engine ends it."""
    req.output_ids.append(token)
    if req.thinking is not None:
        req.thinking.add(token)
    if logprob is not None:
        req.output_logprobs.append(logprob)
    grammar_done = req.guide is not None and advance(req.guide, token)
    if req.first_token_time is None:
        req.first_token_time = now
    p = req.params
    # A stop token ends the request and, like EOS, contributes no text (OpenAI behaviour).
    is_stop_token = token in p.stop_token_ids or (token in eos_token_ids and not p.ignore_eos)
    text = "" if is_stop_token else req.detokenizer.add(token)
    reason = None
    if is_stop_token or req.detokenizer.stopped or grammar_done:
        reason = "stop"
    elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
        reason = "length"
    if reason is not None:
        if not req.detokenizer.stopped:
            text += req.detokenizer.flush()
        req.finish_time = now
    return text, reason


def request_output(
    req: Request,
    new_ids: list[int],
    text: str,
    logprobs: list[TokenLogprob] | None = None,
    leased: list[int] | None = None,
) -> RequestOutput:
    """``req``'s output of this step (``leased``: a finished prefill's pages kept for a
    reader)."""
    prompt_logprobs = None
    if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent and new_ids:
        prompt_logprobs = list(req.prompt_logprobs)
        req.prompt_logprobs_sent = True
    return RequestOutput(
        request_id=req.group_id,
        new_token_ids=new_ids,
        new_text=text,
        finished=all(m.status is RequestStatus.FINISHED for m in req.group),
        finish_reason=req.finish_reason,
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=len(req.output_ids),
        ttft_ms=req.ttft_ms,
        # a resumed request's match may reach past its prompt
        cached=req.cached.with_total(min(req.cached.total, len(req.prompt_ids))),
        index=req.index,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        leased_page_ids=leased,
    )


def generation_result(req: Request) -> GenerationResult:
    """A finished request's whole result (`Engine.generate`)."""
    assert req.first_token_time is not None and req.finish_time is not None
    return GenerationResult(
        request_id=req.request_id,
        text=req.detokenizer.text,
        token_ids=list(req.output_ids),
        prompt_tokens=len(req.prompt_ids),
        cached_tokens=req.cached.total,
        computed_prompt_tokens=req.num_computed_prompt_tokens,
        finish_reason=req.finish_reason or "stop",
        ttft_ms=(req.first_token_time - req.arrival_time) * 1000.0,
        e2e_ms=(req.finish_time - req.arrival_time) * 1000.0,
        index=req.index,
        logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
        prompt_logprobs=(
            list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None
        ),
    )
