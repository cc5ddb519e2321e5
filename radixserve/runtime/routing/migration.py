"""A gateway request's stream over decode workers, and its migration.

A worker that refuses a request because it is draining -> another one; a worker that
goes down, or drains past its grace -> each of its streams **migrates** to another
decode worker with the tokens already streamed (``resume_token_ids``, waiting up to
``migration_wait_s``), at most ``max_migrations`` times, so the caller sees one
uninterrupted stream under its own request id (docs/architecture.md §13). `migrating`
runs the attempts; `ClusterClient` makes each (`Attempt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

from radixserve.engine.fair_share import DEFAULT_SHARE, TenantShare
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import CapacityError, InvalidRequestError, UnavailableError
from radixserve.protocol import RequestFailed
from radixserve.runtime.links import Link

logger = logging.getLogger(__name__)

MAX_DRAINING_RETRIES = 8


@dataclass
class Stream:
    """One attempt's stream on ``link``: its queue, filled by the link's reader."""

    link: Link
    out: asyncio.Queue  # TokenChunk | BaseException
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)


class Draining(UnavailableError):
    """The decode worker refused the request because it is draining (or drained past its
    grace while serving it): continue elsewhere."""


class WorkerLost(UnavailableError):
    """The decode worker serving the request went down: continue elsewhere."""


@dataclass(frozen=True)
class Route:
    """What routes a request besides its prompt: its cache scope (the namespace its
    pages are hashed in, `cache_scope`), its affinity key (`DecodeRouter.pick`) and its
    place in the workers' schedules (`radixserve.engine.fair_share`), its LoRA adapter."""

    scope: str = ""
    key: str = ""
    share: TenantShare = DEFAULT_SHARE
    # its LoRA adapter ("" = the base model), the content it is routed as (only workers
    # serving that fingerprint take it) and that content's page-hash namespace
    adapter: str = ""
    fingerprint: str = ""
    namespace: bytes | None = None


def failure(msg: RequestFailed) -> Exception:
    """The error a worker's `RequestFailed` raises at the gateway."""
    if msg.error_type == "draining":
        return Draining(msg.message)
    if msg.error_type == "invalid_request":
        return InvalidRequestError(msg.message)
    if msg.error_type == "capacity":
        return CapacityError(msg.message)
    return UnavailableError(f"{msg.error_type}: {msg.message}")


def as_first(output: RequestOutput, request_id: str, first: RequestOutput) -> RequestOutput:
    """An output of a moved (or refused and resent) request as the caller knows it: its
    id and the first attempt's TTFT (when its first token came); its cached tokens
    stay those of the attempt that served it."""
    if output.request_id == request_id and output.ttft_ms == first.ttft_ms:
        return output  # the first attempt's own (outputs are frozen): every token but few
    return dataclasses.replace(output, request_id=request_id, ttft_ms=first.ttft_ms)


async def wait_for_worker(pick: Callable[[], Link], wait_s: float) -> Link:
    """``pick()``'s worker, waiting up to ``wait_s`` for one to be up; its
    `UnavailableError` if none came."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return pick()
        except UnavailableError:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(0.05)


#: one attempt: (its request id, params, workers tried (added to), the tokens already
#: streamed, whether to wait for a worker) -> its outputs
Attempt = Callable[
    [str, SamplingParams, set[str], tuple[int, ...], bool], AsyncGenerator[RequestOutput, None]
]


async def migrating(
    attempt: Attempt,
    params: SamplingParams,
    request_id: str,
    max_migrations: int,
    on_moved: Callable[[], None],
) -> AsyncIterator[RequestOutput]:
    """The request's outputs over its attempts (module notes); ``on_moved`` is called
    each time it moves off a lost worker."""
    sent: list[int] = []  # tokens the caller has been given
    first: RequestOutput | None = None  # its first output: TTFT stays its
    tried: set[str] = set()
    refusals = losses = 0
    while True:
        rid = request_id if not refusals + losses else f"{request_id}~{refusals + losses}"
        resumed = params if not sent else dataclasses.replace(params, prompt_logprobs=None)
        outputs = attempt(rid, resumed, tried, tuple(sent), bool(losses))
        streamed_before = len(sent)
        try:
            async with contextlib.aclosing(outputs):  # closing us aborts the request now
                async for output in outputs:
                    first = first or output
                    sent.extend(output.new_token_ids)
                    yield as_first(output, request_id, first)
            return
        except (Draining, WorkerLost) as exc:
            # lost: the worker went away, or drained past its grace after streaming in
            # this attempt; a refusal before any token of it is no loss
            lost = isinstance(exc, WorkerLost) or len(sent) > streamed_before
            losses, refusals = losses + lost, refusals + (not lost)
            if (
                (sent and params.n > 1)
                or losses > max_migrations
                or (refusals > MAX_DRAINING_RETRIES)
            ):
                raise UnavailableError(str(exc)) from None
            if lost:
                tried.clear()  # any worker that is up, the lost one's restart included
                on_moved()
            logger.warning("%s: %s; continuing on another decode worker after %d tokens",
                           request_id, exc, len(sent))  # fmt: skip
