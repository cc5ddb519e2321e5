"""OpenAI's routes. POST /v1/completions and POST /v1/chat/completions (streamed or not):
a body becomes a `Plan` (`plan`), is admitted and started (`Gateway.start`), and its
engine outputs become OpenAI's choices (`choices`), as one body or as chunks. The
discovery and token routes: GET /v1/models, POST /tokenize and /detokenize (in vLLM's
shapes) and GET /version."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from importlib import metadata
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from radixserve.engine.outputs import RequestOutput
from radixserve.errors import InvalidRequestError
from radixserve.model.identity import identity_card
from radixserve.services.gateway.gateway import Gateway, gateway_of
from radixserve.services.gateway.openai_api.bodies import Kind, chunk, envelope, usage, usage_chunk
from radixserve.services.gateway.openai_api.choices import (
    Choice,
    ChoiceBook,
    Generation,
    reply_deltas,
)
from radixserve.services.gateway.openai_api.plan import Plan, chat_plan, completion_plan
from radixserve.services.gateway.openai_api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from radixserve.services.gateway.server.deadline import Deadline
from radixserve.services.gateway.server.errors import OpenAIError, error_body
from radixserve.services.gateway.server.streaming import (
    CLIENT_CLOSED,
    ClosingStreamingResponse,
    collect,
    sse,
)
from radixserve.services.gateway.tools.tool_request import (
    CHAT_TOOLS,
    ToolRequest,
    check_tools,
    template_inputs,
)

logger = logging.getLogger(__name__)

Meta = tuple[Kind, str, int, str]


async def completions(request: Request) -> Response:
    arrived = time.monotonic()
    gw = gateway_of(request)
    req = CompletionRequest.model_validate(await gw.read_json(request))
    adapter = await gw.check_model(req.model)
    deadline = gw.deadline(request, req.timeout, arrived)
    plan = await completion_plan(req, gw.client, gw.settings.max_choices_per_request,
                                 gw.limits, gw.preparer.begin())  # fmt: skip
    return await generate(gw, request, plan, deadline, adapter)


async def chat_completions(request: Request) -> Response:
    arrived = time.monotonic()
    gw = gateway_of(request)
    req = ChatCompletionRequest.model_validate(await gw.read_json(request))
    adapter = await gw.check_model(req.model)
    deadline = gw.deadline(request, req.timeout, arrived)
    s = gw.settings
    plan = await chat_plan(req, gw.client, s.default_max_tokens,
                           s.max_choices_per_request, gw.tool_format, gw.limits,
                           gw.preparer.begin(), gw.reasoning_format)  # fmt: skip
    return await generate(gw, request, plan, deadline, adapter)


async def generate(
    gw: Gateway, request: Request, plan: Plan, deadline: Deadline | None, adapter: str = ""
) -> Response:
    kind: Kind = "completion" if plan.kind == "completion" else "chat"
    rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
    started = await gw.start(request, plan, rid, deadline, adapter)
    if started is None:
        return Response(status_code=CLIENT_CLOSED)
    gen, close = started
    meta: Meta = (kind, rid, int(time.time()), gw.served_as(adapter))
    book = ChoiceBook(plan, gw.formatter)
    if plan.stream:
        return ClosingStreamingResponse(_events(meta, plan, gen, book), close)
    if not await collect(request, gen, book, close):
        return Response(status_code=CLIENT_CLOSED)
    body = envelope(*meta, stream=False)
    body.update(choices=book.full_choices(), usage=usage(_totals(plan, gen)))
    return JSONResponse(body)


def _totals(plan: Plan, gen: Generation) -> list[RequestOutput]:
    totals = [gen.total(j) for j in range(len(plan.jobs))]
    if plan.drop_generated:  # the one token a max_tokens 0 echo ran was not returned
        totals = [dataclasses.replace(t, completion_tokens=0) for t in totals]
    return totals


async def _events(meta: Meta, plan: Plan, gen: Generation, book: ChoiceBook) -> AsyncIterator[str]:
    usage_field = plan.include_usage
    try:
        async for job, out in gen.outputs():
            gen.observe(job, out)
            for choice in _stream_choices(plan, book, job, out):
                yield sse(chunk(meta, choice, usage_field))
        if usage_field:
            yield sse(usage_chunk(meta, _totals(plan, gen)))
        rejected = _rejected_calls(book)
        if rejected:  # after every chunk: an SDK raises here, having read them all
            yield sse(error_body(500, rejected))
    except OpenAIError as exc:  # ended by the gateway (its deadline, a slow client)
        yield sse(error_body(exc.status, exc.message, exc.param))
    except Exception as exc:  # an engine failure mid-stream: tell the client, then end
        logger.exception("stream %s failed", meta[1])
        yield sse(error_body(500, f"generation failed: {exc}"))
    yield "data: [DONE]\n\n"


def _stream_choices(plan: Plan, book: ChoiceBook, job: int, out: Any) -> list[dict[str, Any]]:
    """The chunks' choice objects for one engine output: a choice's opening (chat:
    the role; an echo: the prompt and its logprobs), then its delta if any."""
    key = (job, out.index)
    c = book.add(job, out)
    index = book.index(job, out.index)
    choices = []
    if not c.started:
        c.started = True
        if plan.kind == "chat":
            choices.append({"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})  # fmt: skip
        elif plan.echo:
            choices.append({"index": index, "text": book.echo_text(job),
                            "logprobs": book.completion_logprobs(job, key, [], [], True),
                            "finish_reason": None})  # fmt: skip
    dropped = plan.drop_generated
    ids = [] if dropped else out.new_token_ids
    lps = [] if dropped else (out.logprobs or [])
    text = "" if dropped else out.new_text
    reason = c.finish_reason if out.finish_reason is not None else None
    if plan.kind == "chat":
        choices.extend(_chat_deltas(index, c, text, reason, book.chat_logprobs(lps)))
    elif text or reason or (plan.top_logprobs is not None and ids):
        logprobs = book.completion_logprobs(job, key, ids, lps, False)
        choices.append(
            {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
        )
    return choices


def _chat_deltas(
    index: int, c: Choice, text: str, reason: str | None, logprobs: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """A chat choice's chunks for new text (`reply_deltas`); the last chunk carries the
    finish reason ("tool_calls" when whole calls were found), the first the tokens'
    log-probabilities."""
    deltas = reply_deltas(c, text, reason is not None)
    if reason is not None and c.tools is not None and c.tools.calls and c.tools.complete:
        reason = "tool_calls"
    if not deltas and (reason or (logprobs and logprobs["content"])):
        deltas = [{}]
    return [{"index": index, "delta": delta, "logprobs": logprobs if i == 0 else None,
             "finish_reason": reason if i == len(deltas) - 1 else None}
            for i, delta in enumerate(deltas)]  # fmt: skip


def _rejected_calls(book: ChoiceBook) -> str:
    """Why streamed tool calls were rejected after they opened, per choice ("": none);
    such a choice finished with the engine's reason, not "tool_calls"."""
    return "; ".join(f"choice {book.index(*key)}: {c.tools.error}"
                     for key, c in sorted(book.choices.items())
                     if c.tools is not None and c.tools.error)  # fmt: skip


# -- discovery and tokens -------------------------------------------------------------


def version() -> str:
    try:
        return metadata.version("radixserve")
    except metadata.PackageNotFoundError:
        from radixserve import __version__

        return __version__


async def models(request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    cards = [
        {"id": name, "object": "model", "created": 0, "owned_by": "radixserve",
         "max_model_len": gw.client.max_model_len, "root": gw.client.model_name,
         "identity": identity_card(gw.client.identity)}
        for name in gw.model_names
    ]  # fmt: skip
    cards += [  # vLLM's shape: an adapter's parent is the base model's id
        {"id": name, "object": "model", "created": 0, "owned_by": "radixserve",
         "max_model_len": gw.client.max_model_len, "root": info.path or name,
         "parent": gw.model_name, "fingerprint": info.fingerprint}
        for name, info in sorted(gw.client.adapters().items())
    ]  # fmt: skip
    return {"object": "list", "data": cards}


def _chat_ids(req: TokenizeRequest, tools: ToolRequest | None, gw: Gateway) -> list[int]:
    """The ids of the chat prompt /tokenize shows (CPU work: run in the `Preparer`)."""
    messages, kwargs = template_inputs(req, tools, gw.tool_format)
    text = gw.client.tokenizer.apply_chat_template(
        messages, bool(req.add_generation_prompt), **kwargs
    )
    return gw.client.tokenizer.encode(text, add_special_tokens=False)


async def tokenize(request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    req = TokenizeRequest.model_validate(await gw.read_json(request))
    await gw.check_model(req.model)
    tokenizer = gw.client.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        tools = check_tools(req.tools, None, None, False, CHAT_TOOLS, gw.limits)
        ids = await gw.preparer.begin().run("messages", _chat_ids, req, tools, gw)
    elif req.tools is not None:
        raise InvalidRequestError("tools are rendered by the chat template: give them with "
                                  "messages, not with prompt", param="tools")  # fmt: skip
    else:
        encode = partial(tokenizer.encode, req.prompt or "",
                         add_special_tokens=bool(req.add_special_tokens))  # fmt: skip
        ids = await gw.preparer.begin().run("prompt", encode)
    strs = [gw.formatter.text(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": gw.client.max_model_len, "tokens": ids,
            "token_strs": strs}  # fmt: skip


async def detokenize(request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    req = DetokenizeRequest.model_validate(await gw.read_json(request))
    await gw.check_model(req.model)
    vocab = gw.client.tokenizer.vocab_size
    bad = [t for t in req.tokens if t >= vocab]
    if bad:
        raise InvalidRequestError(
            f"tokens holds {bad[0]}, outside the vocabulary [0, {vocab})", param="tokens"
        )
    return {"prompt": gw.client.tokenizer.decode(req.tokens)}


async def version_route() -> dict[str, str]:
    return {"version": version()}
