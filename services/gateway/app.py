"""The OpenAI-compatible HTTP gateway: `create_app(client, settings) -> FastAPI`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream or not), POST
/v1/responses with GET and DELETE /v1/responses/{id} (the Responses API: see
`response_request`, `response_output`, `response_store`), GET /v1/models, POST
/tokenize, POST /detokenize, GET /version, GET /health (ready: a decode worker, or the
in-process engine, can serve), GET /live, GET /metrics, GET /debug/cache, and
FastAPI's own GET /openapi.json and /docs. Contracts:

* every error is an OpenAI error object (see `errors`); bad input never crashes it;
* a generation is admitted against the cluster's and its tenant's bounds (`admission`:
  work = prompt tokens + choices x max_tokens, prompts, rates); one over a bound is
  refused at once with 429 (nothing waits), one that never fits with 400; its charge is
  released exactly once, when its response ends, however it ends;
* a client that disconnects has its request aborted in the engine: a stream's response
  closes the engine streams whatever way it ends, a non-streamed request watches its
  connection while it collects; a stream whose client reads nothing is cut
  (`http_server`), or aborted once it falls ``stream_buffer_outputs`` behind (`choices`);
* a body must arrive within ``body_read_timeout_s`` (else 408), and a request may set a
  deadline (`deadline`), past which it is aborted with a 408.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.engine.outputs import RequestOutput
from radixserve.metrics import CONTENT_TYPE, ServingMetrics
from radixserve.model.identity import identity_card
from radixserve.services.gateway.admission import Refused, Ticket, sequences_of, work_of
from radixserve.services.gateway.choices import (
    Choice,
    ChoiceBook,
    ClientGone,
    Generation,
    reply_deltas,
)
from radixserve.services.gateway.deadline import Deadline, request_deadline
from radixserve.services.gateway.engine_client import EngineClient
from radixserve.services.gateway.errors import (
    OpenAIError,
    error_body,
)
from radixserve.services.gateway.logprobs import LogprobFormatter
from radixserve.services.gateway.plan import Plan, chat_plan, completion_plan
from radixserve.services.gateway.preparer import Preparer
from radixserve.services.gateway.reasoning import ReasoningFormat
from radixserve.services.gateway.request_log import RequestLog, trace_id_of
from radixserve.services.gateway.request_tracing import request_span
from radixserve.services.gateway.response_output import (
    ResponseBuilder,
    new_id,
    response_usage,
)
from radixserve.services.gateway.response_request import (
    ResponsesRequest,
    canonical,
    input_item,
    response_plan,
)
from radixserve.services.gateway.response_store import ResponseStore, Turn
from radixserve.services.gateway.responses import (
    Kind,
    chunk,
    envelope,
    usage,
    usage_chunk,
)
from radixserve.services.gateway.router import affinity_key
from radixserve.services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.gateway.tenants import ANONYMOUS, Principal
from radixserve.services.gateway.tools import ToolFormat

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # the client closed the connection (nginx's convention); never seen
Meta = tuple[Kind, str, int, str]


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _typed_sse(event: dict[str, Any]) -> str:
    """A Responses API event, named by its type as OpenAI sends it."""
    return f"event: {event['type']}\n{_sse(event)}"


def caller(request: Request) -> Principal:
    """The `Principal` that `Gateway.authorize` found for ``request`` (called first)."""
    principal: Principal = request.state.principal
    return principal


def _stored_id(request: Request) -> str:
    """The id in a stored response's path (read here, not declared as a FastAPI
    parameter, so /openapi.json documents no 422); it takes no query parameters."""
    for name in request.query_params:
        raise OpenAIError(400, f"{name} is not served on stored responses (include, stream "
                          "and starting_after are not): leave it out", name)  # fmt: skip
    return str(request.path_params["response_id"])


async def _until_disconnect(request: Request, gen: Generation) -> None:
    """Wait for the client to close its connection (its body was read: nothing else
    arrives), then end ``gen`` with `ClientGone`."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gen.end("disconnected", ClientGone())


async def collect(
    request: Request, gen: Generation, book: ChoiceBook, close: Callable[[], Awaitable[None]]
) -> bool:
    """Every output of a non-streamed request into `book`; then `close`. False if the
    client left first (the request is then aborted)."""
    watch = asyncio.ensure_future(_until_disconnect(request, gen))
    try:
        async for job, out in gen.outputs():
            gen.observe(job, out)
            book.add(job, out)
        return True
    except ClientGone:
        logger.info("client left before the reply; aborted")
        return False
    finally:
        watch.cancel()
        await close()


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close` when it is done, however it ends
    (finished, client gone, cancelled), so the engine streams are never left open."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            body = self.body_iterator
            if hasattr(body, "aclose"):
                await body.aclose()
            await self._on_close()


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


class Gateway:
    """State and handlers behind the routes (`routes.create_app` lays them out)."""

    def __init__(self, client: EngineClient, settings: GatewaySettings) -> None:
        self.client = client
        self.settings = settings
        aliases = settings.served_model_name
        self.model_names = aliases.split(",") if aliases else [client.served_name]
        self.model_name = self.model_names[0]
        self.metrics = ServingMetrics(self.model_name)
        self.formatter = LogprobFormatter(client.tokenizer)
        self.tool_format = ToolFormat.for_template(client.tokenizer.chat_template,
                                                   settings.tool_parser)  # fmt: skip
        self.reasoning_format = ReasoningFormat.for_template(client.tokenizer.chat_template,
                                                             settings.reasoning_parser)  # fmt: skip
        self.responses = ResponseStore(settings.response_store_size, settings.response_store_ttl_s)
        self.requests = RequestLog(settings.explorer_request_log_size)  # for /explorer
        self.keys = settings.keyring()  # empty: no authentication, every caller ANONYMOUS
        self.admission = settings.admission(self.keys)  # what is in flight, per tenant
        self.limits = settings.prepare_limits()  # checked before anything is prepared
        self.preparer = Preparer(settings.prepare_workers, settings.prepare_timeout_s)

    # -- admission, auth, body -------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Sequences (prompts x choices) in flight, as `admission` counts them."""
        return self.admission.requests

    def acquire(self, tenant: str, plan: Plan) -> Ticket:
        """Admit ``plan`` for ``tenant`` (`admission.Admission.admit`): its ticket, or a
        400/429 counted by reason."""
        try:
            ticket = self.admission.admit(tenant, work_of(plan), sequences_of(plan))
        except Refused as refused:
            self.metrics.refusals.labels(reason=refused.reason).inc()
            raise
        self._gauge_admission()
        return ticket

    def release(self, ticket: Ticket) -> None:
        self.admission.release(ticket)  # idempotent
        self._gauge_admission()

    def _gauge_admission(self) -> None:
        self.metrics.queue_depth.set(self.admission.requests)
        self.metrics.queued_work.set(self.admission.work)

    def authorize(self, request: Request) -> Principal:
        """The caller's `Principal` (401 without a valid key when keys are configured)."""
        principal: Principal | None = ANONYMOUS
        if self.keys:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
                token = request.headers.get("x-api-key", "")
            principal = self.keys.principal(token.strip()) if token.strip() else None
        if principal is None:
            raise OpenAIError(401, "missing or invalid API key (Authorization: Bearer <key>, "
                              "or x-api-key: <key>)")  # fmt: skip
        request.state.principal = principal  # read back by `caller`
        return principal

    def authorize_admin(self, request: Request) -> Principal:
        """The caller, who must hold an admin key (403 for a user key): the operator's
        routes (/debug/*, /explorer, the cache audit's clear)."""
        principal = self.authorize(request)
        if not principal.is_admin:
            raise OpenAIError(403, "this route needs an admin API key (a key entry with "
                              '"role": "admin")')  # fmt: skip
        return principal

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object: 413 over the size limit, 400 if not UTF-8 JSON."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise OpenAIError(413, f"request body over {limit} bytes")
        chunks: list[bytes] = []

        async def receive() -> None:
            size = 0
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise OpenAIError(413, f"request body over {limit} bytes")
                chunks.append(part)

        timeout_s = self.settings.body_read_timeout_s
        try:  # (asyncio.wait_for: asyncio.timeout needs Python 3.11)
            await asyncio.wait_for(receive(), timeout_s)
        except asyncio.TimeoutError:
            self.metrics.cut_connections.labels(reason="body_timeout").inc()
            raise OpenAIError(
                408,
                f"the request body did not arrive within {timeout_s:g} s (body_read_timeout_s)",
                headers={"Connection": "close"},
            ) from None
        try:
            text = b"".join(chunks).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise OpenAIError(400, f"request body is not valid UTF-8: {exc.reason}") from None
        try:
            body = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise OpenAIError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body must be a JSON object")
        return body

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (*self.model_names, "default"):
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")

    # -- generation endpoints --------------------------------------------------------

    def deadline(self, request: Request, timeout: float | None, arrived: float) -> Deadline | None:
        return request_deadline(request, timeout, self.settings.max_request_timeout_s, arrived)

    async def completions(self, request: Request) -> Response:
        arrived = time.monotonic()
        self.authorize(request)
        req = CompletionRequest.model_validate(await self.read_json(request))
        self.check_model(req.model)
        deadline = self.deadline(request, req.timeout, arrived)
        plan = await completion_plan(req, self.client, self.settings.max_choices_per_request,
                                     self.limits, self.preparer.begin())  # fmt: skip
        return await self.generate(request, plan, deadline)

    async def chat_completions(self, request: Request) -> Response:
        arrived = time.monotonic()
        self.authorize(request)
        req = ChatCompletionRequest.model_validate(await self.read_json(request))
        self.check_model(req.model)
        deadline = self.deadline(request, req.timeout, arrived)
        s = self.settings
        plan = await chat_plan(req, self.client, s.default_max_tokens,
                               s.max_choices_per_request, self.tool_format, self.limits,
                               self.preparer.begin(), self.reasoning_format)  # fmt: skip
        return await self.generate(request, plan, deadline)

    async def generate(self, request: Request, plan: Plan, deadline: Deadline | None) -> Response:
        kind: Kind = "completion" if plan.kind == "completion" else "chat"
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        started = await self.start(request, plan, rid, deadline)
        if started is None:
            return Response(status_code=CLIENT_CLOSED)
        gen, close = started
        meta: Meta = (kind, rid, int(time.time()), self.model_name)
        book = ChoiceBook(plan, self.formatter)
        if plan.stream:
            return ClosingStreamingResponse(self._events(meta, plan, gen, book), close)
        if not await collect(request, gen, book, close):
            return Response(status_code=CLIENT_CLOSED)
        body = envelope(*meta, stream=False)
        body.update(choices=book.full_choices(), usage=usage(self._totals(plan, gen)))
        return JSONResponse(body)

    async def start(
        self, request: Request, plan: Plan, rid: str, deadline: Deadline | None
    ) -> tuple[Generation, Callable[[], Awaitable[None]]] | None:
        """Admit the plan's jobs and wait for their first outputs: the generation and
        the idempotent `close` that ends it and releases the admission (the caller hands
        it to whatever ends the response); None (all closed) if the client left first. A
        `RequestError` is raised here (a 400), a `Refused` before anything starts."""
        jobs = plan.jobs
        principal = caller(request)
        tenant = principal.tenant
        share = principal.share(plan.priority)  # 403 before anything is charged
        ticket = self.acquire(tenant, plan)
        try:  # until `close` owns the ticket, a failure here returns it
            record = self.requests.begin(rid, plan.kind, trace_id_of(request), len(jobs), tenant)
            span = request_span(request)
            span.set(request_id=rid, prompts=len(jobs), tenant=tenant)
            scope = principal.cache_scope(plan.cache_salt)  # whose cached KV it may share
            key = affinity_key(tenant, plan.prompt_cache_key)
            streams = [
                self.client.generate(
                    job.prompt_ids,
                    job.params,
                    rid if len(jobs) == 1 else f"{rid}-{i}",
                    span=span,
                    cache_scope=scope,
                    routing_key=key,
                    share=share,
                )  # fmt: skip
                for i, job in enumerate(jobs)
            ]
            gen = Generation(streams, self.metrics, deadline, self.settings.stream_buffer_outputs)
        except BaseException:
            self.release(ticket)
            raise
        released = failed = False

        async def close() -> None:
            nonlocal released
            try:
                await gen.close()
            finally:
                if not released:
                    released = True
                    self.release(ticket)
                    self.requests.finish(record, gen.lasts, sum(gen.tokens), failed)
                    reason = gen.ended_by if failed else gen.abort_reason
                    if reason is not None:
                        self.metrics.aborted.labels(reason=reason).inc()

        try:
            started = await gen.first(request.is_disconnected)  # RequestError → 400
        except BaseException:
            failed = True
            await close()
            raise
        if not started:  # the client left before the first token (e.g. during prefill)
            logger.info("client left before the first token; aborting")
            await close()
            return None
        self.requests.first_token(record)
        return gen, close

    @staticmethod
    def _totals(plan: Plan, gen: Generation) -> list[RequestOutput]:
        totals = [gen.total(j) for j in range(len(plan.jobs))]
        if plan.drop_generated:  # the one token a max_tokens 0 echo ran was not returned
            totals = [dataclasses.replace(t, completion_tokens=0) for t in totals]
        return totals

    async def _events(
        self, meta: Meta, plan: Plan, gen: Generation, book: ChoiceBook
    ) -> AsyncIterator[str]:
        usage_field = plan.include_usage
        try:
            async for job, out in gen.outputs():
                gen.observe(job, out)
                for choice in self._stream_choices(plan, book, job, out):
                    yield _sse(chunk(meta, choice, usage_field))
            if usage_field:
                yield _sse(usage_chunk(meta, self._totals(plan, gen)))
            rejected = _rejected_calls(book)
            if rejected:  # after every chunk: an SDK raises here, having read them all
                yield _sse(error_body(500, rejected))
        except OpenAIError as exc:  # ended by the gateway (its deadline, a slow client)
            yield _sse(error_body(exc.status, exc.message, exc.param))
        except Exception as exc:  # an engine failure mid-stream: tell the client, then end
            logger.exception("stream %s failed", meta[1])
            yield _sse(error_body(500, f"generation failed: {exc}"))
        yield "data: [DONE]\n\n"

    @staticmethod
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
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "finish_reason": reason,
                    "logprobs": book.completion_logprobs(job, key, ids, lps, False),
                }
            )
        return choices  # fmt: skip

    # -- the Responses API -----------------------------------------------------------

    async def create_response(self, request: Request) -> Response:
        arrived = time.monotonic()
        self.authorize(request)
        req = ResponsesRequest.checked(await self.read_json(request))
        self.check_model(req.model)
        deadline = self.deadline(request, req.timeout, arrived)
        parent = None
        if req.previous_response_id is not None:
            parent = self.responses.turn(req.previous_response_id, "previous_response_id",
                                         caller(request))  # fmt: skip
        history = parent.conversation() if parent else []
        plan = await response_plan(req, history, self.client, self.settings.default_max_tokens,
                                   self.tool_format, self.limits,
                                   self.preparer.begin(), self.reasoning_format)  # fmt: skip
        rid = new_id("resp")
        started = await self.start(request, plan, rid, deadline)
        if started is None:
            return Response(status_code=CLIENT_CLOSED)
        gen, close = started
        builder = ResponseBuilder({
            "id": rid, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "background": False, "error": None,
            "incomplete_details": None, "model": self.model_name, "output": [],
            "truncation": "disabled", "usage": None, **req.echo(),
        })  # fmt: skip
        book = ChoiceBook(plan, self.formatter)
        if plan.stream:
            events = self._response_events(req, parent, builder, gen, book, caller(request))
            return ClosingStreamingResponse(events, close)
        if not await collect(request, gen, book, close):
            return Response(status_code=CLIENT_CLOSED)
        c = book.choices[(0, 0)]
        builder.feed(reply_deltas(c, "".join(c.text), finished=True))
        builder.finish(c.finish_reason, response_usage(gen.total(0)))
        self._keep(req, parent, builder.body, caller(request))
        return JSONResponse(builder.body)

    async def _response_events(
        self, req: ResponsesRequest, parent: Turn | None, builder: ResponseBuilder,
        gen: Generation, book: ChoiceBook, principal: Principal,
    ) -> AsyncIterator[str]:  # fmt: skip
        """The typed events of a streamed response; it is stored before the last."""
        try:
            for event in builder.opening():
                yield _typed_sse(event)
            async for job, out in gen.outputs():
                gen.observe(job, out)
                c = book.add(job, out)
                deltas = reply_deltas(c, out.new_text, out.finish_reason is not None)
                for event in builder.feed(deltas):
                    yield _typed_sse(event)
            c = book.choices[(0, 0)]
            rejected = c.tools.error if c.tools is not None else None
            closing = builder.finish(c.finish_reason, response_usage(gen.total(0)), rejected)
            if builder.body["status"] != "failed":
                self._keep(req, parent, builder.body, principal)
            for event in closing:
                yield _typed_sse(event)
        except Exception as exc:  # an engine failure mid-stream (or the gateway's end of
            # it: its deadline, a slow client): tell the client, then end
            failure = exc.message if isinstance(exc, OpenAIError) else f"generation failed: {exc}"
            if not isinstance(exc, OpenAIError):
                logger.exception("response stream %s failed", builder.body["id"])
            for event in builder.failed(failure):
                yield _typed_sse(event)

    def _keep(
        self, req: ResponsesRequest, parent: Turn | None, body: dict[str, Any], owner: Principal
    ) -> None:
        """Store a finished response (unless ``store: false``) with its turn: this
        request's input, then its output, after the conversation it continued; it
        belongs to ``owner``'s tenant."""
        if not req.stored:
            return
        outputs = [canonical(input_item(item, "output")) for item in body["output"]]
        turn = Turn((*req.items(), *outputs), parent, num_outputs=len(outputs))
        self.responses.put(body["id"], body, turn, owner.tenant)

    async def get_response(self, request: Request) -> JSONResponse:
        principal = self.authorize(request)
        response_id = _stored_id(request)
        return JSONResponse(self.responses.body(response_id, "response_id", principal))

    async def delete_response(self, request: Request) -> dict[str, Any]:
        principal = self.authorize(request)
        response_id = _stored_id(request)
        self.responses.delete(response_id, "response_id", principal)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # -- operations ------------------------------------------------------------------

    async def health(self) -> JSONResponse:
        ok, detail = self.client.health()
        body = {"status": "ok" if ok else "unavailable", "model": self.model_name, **detail}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def live(self) -> dict[str, str]:
        return {"status": "alive"}

    async def metrics_text(self) -> Response:
        body = self.metrics.render(self.client.stats(), self.client.worker_stats())
        return Response(body, media_type=CONTENT_TYPE)

    async def debug_cache(self, request: Request) -> dict[str, Any]:
        self.authorize_admin(request)
        body: dict[str, Any] = {
            **self.client.stats(),
            "gateway_in_flight": self.in_flight,
            "gateway_admission": self.admission.snapshot(),  # names tenants: admins only
            "cache_namespace": self.client.model_name,  # the checkpoint's own name
            "model_identity": identity_card(self.client.identity),
        }
        workers = self.client.worker_stats()
        if workers:
            body["workers"] = workers
        return body

    async def clear_cache_audit(self, request: Request) -> dict[str, Any]:
        """POST /debug/cache/audit/clear: the operator's all-clear after a failed-closed
        cache audit; every engine drops its cached pages and serves from its cache
        again. Answers each worker's name -> whether it had failed closed (null: no
        answer in time)."""
        self.authorize_admin(request)
        return {"workers": await self.client.clear_cache_audit()}
