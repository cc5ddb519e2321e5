"""The gateway's state (`Gateway`) and the steps every generation route takes: authorize
the caller, read the body, admit the plan, start it in the engine.

Contracts:

* every error is an OpenAI error object (`server.errors`); bad input never crashes it;
* a generation is admitted against the cluster's and its tenant's bounds
  (`tenancy.admission`: work = prompt tokens + choices x max_tokens, prompts, rates);
  one over a bound is refused at once with 429 (nothing waits), one that never fits
  with 400; its charge is released exactly once, when its response ends, however it ends;
* a client that disconnects has its request aborted in the engine: a stream's response
  closes the engine streams whatever way it ends, a non-streamed request watches its
  connection while it collects (`server.streaming`); a stream whose client reads nothing
  is cut (`server.http_server`), or aborted once it falls ``stream_buffer_outputs``
  behind (`openai_api.choices`);
* a body must arrive within ``body_read_timeout_s`` (else 408), and a request may set a
  deadline (`server.deadline`), past which it is aborted with a 408.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import Request

from radixserve.metrics import ServingMetrics
from radixserve.runtime.engine_client import EngineClient
from radixserve.runtime.routing.router import affinity_key
from radixserve.services.gateway.openai_api.choices import Generation
from radixserve.services.gateway.openai_api.logprobs import LogprobFormatter
from radixserve.services.gateway.openai_api.lora_resolver import LoraResolver
from radixserve.services.gateway.openai_api.plan import Plan
from radixserve.services.gateway.openai_api.preparer import Preparer
from radixserve.services.gateway.ops.request_log import RequestLog, trace_id_of
from radixserve.services.gateway.responses_api.store import ResponseStore
from radixserve.services.gateway.server.deadline import Deadline, request_deadline
from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.services.gateway.server.request_tracing import request_span
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.gateway.tenancy.admission import Refused, Ticket, sequences_of, work_of
from radixserve.services.gateway.tenancy.tenants import ANONYMOUS, Principal
from radixserve.services.gateway.tools.reasoning import ReasoningFormat
from radixserve.services.gateway.tools.tool_request import ToolFormat

logger = logging.getLogger(__name__)


def caller(request: Request) -> Principal:
    """The `Principal` that `Gateway.authorize` found for ``request`` (called first)."""
    principal: Principal = request.state.principal
    return principal


def gateway_of(request: Request, role: Literal["user", "admin", "none"] = "user") -> Gateway:
    """The `Gateway` of the app serving ``request``, its caller authorized as ``role``
    (an admin key for the operator's routes; "none" for health and metrics)."""
    gw: Gateway = request.app.state.gateway
    if role == "admin":
        gw.authorize_admin(request)
    elif role == "user":
        gw.authorize(request)
    return gw


class Gateway:
    """What the routes share: the engine client, settings, metrics, stores and bounds."""

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
        on_demand = settings.lora_dir if settings.lora_load_on_demand else None
        self.lora_resolver = LoraResolver(client, on_demand) if on_demand is not None else None

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

    async def check_model(self, model: str | None) -> str:
        """The LoRA adapter ``model`` names ("" for the base model: one of its names,
        "default" or none), loaded first if it names an adapter directory in lora_dir
        (``lora_load_on_demand``: `LoraResolver`); 404 naming it if it is neither."""
        if model is None or model in (*self.model_names, "default"):
            return ""
        if model in self.client.adapters():
            return model
        if self.lora_resolver is not None and await self.lora_resolver.load(model):
            return model
        raise OpenAIError(404, f"The model `{model}` does not exist.", "model")

    def served_as(self, adapter: str) -> str:
        """The model id a response names: the adapter's, else the base model's."""
        return adapter or self.model_name

    def deadline(self, request: Request, timeout: float | None, arrived: float) -> Deadline | None:
        return request_deadline(request, timeout, self.settings.max_request_timeout_s, arrived)

    async def start(
        self, request: Request, plan: Plan, rid: str, deadline: Deadline | None, adapter: str = ""
    ) -> tuple[Generation, Callable[[], Awaitable[None]]] | None:
        """Admit the plan's jobs and wait for their first outputs: the generation and
        the idempotent `close` that ends it and releases the admission (the caller hands
        it to whatever ends the response); None (all closed) if the client left first. A
        `RequestError` is raised here (a 400), a `Refused` before anything starts. The jobs
        run with LoRA ``adapter`` ("" = the base model; `check_model`)."""
        jobs = plan.jobs
        principal = caller(request)
        tenant = principal.tenant
        share = principal.share(plan.priority)  # 403 before anything is charged
        ticket = self.acquire(tenant, plan)
        loras = self.metrics.vllm.lora  # vllm:lora_requests_info
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
                    adapter=adapter,
                )  # fmt: skip
                for i, job in enumerate(jobs)
            ]
            gen = Generation(streams, self.metrics, deadline, self.settings.stream_buffer_outputs,
                             adapter)  # fmt: skip
        except BaseException:
            self.release(ticket)
            raise
        released = failed = running = False
        loras.waiting(adapter)

        async def close() -> None:
            nonlocal released
            try:
                await gen.close()
            finally:
                if not released:
                    released = True
                    loras.finished(adapter, running)
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
        running = True
        loras.running(adapter)
        return gen, close
