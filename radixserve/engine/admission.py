"""Admission: one engine operation decides how a request's prompt gets its KV.

A worker hands the engine a request once (`Engine.admit`), between two steps, and gets an
`Admission` back saying what happens next — nothing else on the way to its first token
waits for a step:

* ``local``: the request is queued; its uncached delta joins the next step.
* ``remote`` (decode side): pages are reserved for the part of the prompt this engine
  lacks; a prefill worker fills them, then `Engine.activate_remote` continues it.
* ``host``: the device-cached head is locked and pages are allocated for the prefix the
  kvstore's host tier holds (a `HostPlan` the worker leased); the worker reads the host
  pages into them, then `Engine.finish_host_admission` caches the prefix and queues the
  request, which then finds it cached (or, if the read failed, computes it).

The route (`choose_route`): with ``remote_over`` set (a decode worker with a prefill
worker ready), remote if more than that many prompt tokens would still be uncached after
the host tier's part — the prefill worker loads that part itself — else host if the plan
adds pages, else local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Route = Literal["local", "remote", "host"]


@dataclass(frozen=True)
class HostPlan:
    """A host-tier lease the worker holds for a prompt: past the ``device_pages`` it found
    on device (its mirror of the cache), ``num_pages`` more pages are in the host tier."""

    device_pages: int
    num_pages: int


@dataclass(frozen=True)
class Admission:
    """What `Engine.admit` decided, and the pages the caller fills (remote, host)."""

    request_id: str
    route: Route
    cached_tokens: int  # prompt tokens already on this engine's device (page-aligned)
    page_ids: tuple[int, ...] = ()  # remote: for the prefill worker's KV; host: for the read


def choose_route(prompt_len: int, cached: int, host_tokens: int, remote_over: int | None) -> Route:
    """The route of a prompt of ``prompt_len`` tokens with ``cached`` of them on device
    and ``host_tokens`` more loadable from the host tier (see the module notes)."""
    if remote_over is not None and prompt_len - cached - host_tokens > remote_over:
        return "remote"
    return "host" if host_tokens > 0 else "local"
