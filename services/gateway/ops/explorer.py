"""The operator's live view of the cluster: GET /explorer and its JSON under /debug/explorer.

The page (``static/explorer.*``, plain HTML, CSS and JS served as one document, no build
step) polls four endpoints and draws what they return:

* ``/debug/explorer/workers``: every worker's role, state, TP size and pages (device;
  the kvstore's host and disk tiers), its hit rate over the requests this gateway
  finished in the last minutes (`RequestLog.hit_rates`), its live requests and their
  phase (each worker's answer to a `CacheTreeQuery` asking for no nodes), the cache
  audit's counters where a worker reports them, and per drafting method its speculative
  decoding (tokens drafted and kept, tokens a verification appends);
* ``/debug/explorer/tree?worker=NAME&nodes=N``: that worker's N largest radix nodes
  (token and page counts, hits, locks, last hit, the requests that used each);
* ``/debug/explorer/requests?limit=N``: the gateway's ring of recent requests
  (`request_log`), each with its trace id (the page draws ``/debug/traces/{id}``);
* ``/debug/explorer/autoscaler``: the autoscaler's recent decisions, read from its
  /health (``autoscaler_url``), or that none is configured.

Every route needs an admin API key, like /debug/cache (a user key gets 403: the page
lists every tenant's requests and the cache's recent request ids); the request list is
scoped to the caller's tenant too. A browser cannot put a header on the page's own
request, so the page alone also takes the key as ``?key=``; its script sends it on as
``Authorization: Bearer`` to the JSON routes. Prompt text appears only
with ``explorer_prompt_text``: otherwise the gateway asks the workers for none, and
nothing here carries any (token counts only).
"""

from __future__ import annotations

import asyncio
import dataclasses
from functools import cache
from importlib import resources
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import HTMLResponse

from radixserve.protocol.stats_messages import EngineSection, ServiceStats, fill
from radixserve.protocol.view_messages import MAX_TREE_NODES, CacheTreeReply
from radixserve.runtime.engine_client import LOCAL_WORKER
from radixserve.services.gateway.gateway import Gateway, caller, gateway_of
from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.services.gateway.server.query import int_param
from radixserve.worker_metrics import WorkerView

TEXT_TOKENS = 12  # a node's first tokens shown as text (with explorer_prompt_text)
DEFAULT_NODES = 48
MAX_LISTED_REQUESTS = 1000
AUTOSCALER_TIMEOUT_S = 1.0


@cache
def page_html() -> str:
    """The page: its HTML with its stylesheet and script inlined (one authorized GET)."""
    folder = resources.files("radixserve.services.gateway") / "static"
    html = (folder / "explorer.html").read_text(encoding="utf-8")
    css = (folder / "explorer.css").read_text(encoding="utf-8")
    js = (folder / "explorer.js").read_text(encoding="utf-8")
    return html.replace("/*EXPLORER_CSS*/", css).replace("/*EXPLORER_JS*/", js)


def _present(**values: int | None) -> dict[str, int]:
    return {k: v for k, v in values.items() if v is not None}


def _state(view: WorkerView) -> str:
    if not view.up:
        return "down"
    return "draining" if view.load is not None and view.load.draining else "up"


def _tiers(stats: ServiceStats | None) -> dict[str, dict[str, int]]:
    """The pages of each tier the worker reports: its own device pool, and (the kvstore)
    its host-memory and disk tiers."""
    tiers: dict[str, dict[str, int]] = {}
    e = stats.engine if stats is not None else None
    if e is not None:
        tiers["device"] = _present(
            pages_total=e.pages_total, pages_used=e.pages_used, pages_free=e.pages_free,
            pages_cached=e.pages_cached, pages_locked=e.pages_locked,
            pages_evictable=e.pages_evictable, page_bytes=e.page_bytes,
            live_requests=e.live_requests,
        )  # fmt: skip
    kv = stats.kvstore if stats is not None else None
    host, disk = (kv.host, kv.disk) if kv is not None else (None, None)
    if host is not None and host.host_pages_total is not None:
        tiers["host"] = _present(
            total=host.host_pages_total, used=host.host_pages_used, free=host.host_pages_free,
            stored=host.host_pages_stored, leased=host.host_pages_leased,
        )  # fmt: skip
    if disk is not None:
        tiers["disk"] = _present(
            total=disk.disk_pages_total, used=disk.disk_pages_used, free=disk.disk_pages_free,
            stored=disk.disk_pages_stored, leased=disk.disk_pages_leased,
        )  # fmt: skip
    return tiers


def _load(view: WorkerView) -> dict[str, int]:
    load = view.load
    if load is None:
        return _present(gateway_in_flight=view.gateway_in_flight)
    return _present(running=load.running, waiting=load.waiting,
                    queued_tokens=load.queued_tokens,
                    gateway_in_flight=view.gateway_in_flight)  # fmt: skip


def _audit(stats: ServiceStats | None) -> dict[str, int]:
    e = stats.engine if stats is not None else None
    if e is None:
        return {}
    return _present(audit_checked=e.audit_checked, audit_mismatches=e.audit_mismatches,
                    audit_fail_closed=e.audit_fail_closed)  # fmt: skip


def _speculation(stats: ServiceStats | None) -> dict[str, dict[str, float]]:
    """Per drafting method that verified drafts: its counters, the share of draft tokens
    kept and the tokens a verification appended on average."""
    e = stats.engine if stats is not None else None
    out: dict[str, dict[str, float]] = {}
    for method in ("prompt", "radix") if e is not None else ():
        steps = getattr(e, f"speculative_{method}_steps_total")
        if not steps:
            continue
        drafted = getattr(e, f"speculative_{method}_drafted_total")
        accepted = getattr(e, f"speculative_{method}_accepted_total")
        out[method] = {"steps": steps, "drafted": drafted, "accepted": accepted,
                       "acceptance": accepted / drafted if drafted else 0.0,
                       "tokens_per_step": getattr(e, f"speculative_{method}_emitted_total") / steps}  # fmt: skip
    return out


def _loras(stats: ServiceStats | None) -> dict[str, dict[str, str]]:
    """``{"loras": {name: fingerprint}}`` of the LoRA adapters a worker serves; nothing
    when none."""
    loras = {info.name: info.fingerprint for info in stats.loras} if stats is not None else {}
    return {"loras": loras} if loras else {}


def _live(reply: CacheTreeReply | None) -> dict[str, Any] | None:
    if reply is None:
        return None
    return {"requests": [dataclasses.asdict(r) for r in reply.requests], "count": reply.num_live}


def _text_tokens(gw: Gateway) -> int:
    """Tokens of a node shown as text: none without ``explorer_prompt_text``."""
    return TEXT_TOKENS if gw.settings.explorer_prompt_text else 0


async def page(request: Request) -> HTMLResponse:
    gw = gateway_of(request, "none")
    key = request.query_params.get("key")
    if key is None or not gw.keys:
        gw.authorize_admin(request)
    else:
        principal = gw.keys.principal(key)
        if principal is None:
            raise OpenAIError(401, "invalid API key in ?key=", "key")
        if not principal.is_admin:
            raise OpenAIError(403, "the explorer needs an admin API key", "key")
    headers = {"cache-control": "no-store", "referrer-policy": "no-referrer"}
    return HTMLResponse(page_html(), headers=headers)


def _workers(gw: Gateway) -> dict[str, WorkerView]:
    workers = gw.client.worker_stats()
    if workers:
        return workers
    engine = fill(EngineSection, gw.client.stats())  # the in-process engine's pool
    stats = ServiceStats(engine=engine, loras=tuple(gw.client.adapters().values()))
    return {LOCAL_WORKER: WorkerView("engine", True, stats=stats)}


async def workers(request: Request) -> dict[str, Any]:
    gw = gateway_of(request, "admin")
    found = _workers(gw)
    rates = gw.requests.hit_rates()
    names = [n for n, w in found.items() if w.up and w.role != "kvstore"]
    replies = await asyncio.gather(*(gw.client.cache_tree(n, 0, 0) for n in names))
    live = dict(zip(names, replies))
    listed = [{
        "name": name, "role": view.role, "state": _state(view), "address": view.address,
        "tp_size": 1 if view.tp_size is None else view.tp_size,
        "tiers": _tiers(view.stats), "load": _load(view),
        "hit_rate": rates.get(name), "live": _live(live.get(name)),
        "audit": _audit(view.stats), "speculation": _speculation(view.stats),
        **_loras(view.stats),
    } for name, view in sorted(found.items(), key=lambda kv: (kv[1].role, kv[0]))]  # fmt: skip
    return {"workers": listed, "hit_rate": rates.get(""),
            "gateway_in_flight": gw.admission.requests,  # sequences (prompts x choices)
            "prompt_text": _text_tokens(gw) > 0}  # fmt: skip


async def tree(request: Request) -> dict[str, Any]:
    gw = gateway_of(request, "admin")
    text_tokens = _text_tokens(gw)
    worker = request.query_params.get("worker", "")
    nodes = int_param(request, "nodes", DEFAULT_NODES, 1, MAX_TREE_NODES)
    if not worker:
        raise OpenAIError(400, "worker is required: a worker's name from "
                          "/debug/explorer/workers", "worker")  # fmt: skip
    reply = await gw.client.cache_tree(worker, nodes, text_tokens)
    if reply is None:
        raise OpenAIError(404, f"no worker {worker!r} is up to describe its cache "
                          "(or it did not answer in time)", "worker")  # fmt: skip
    listed = [dataclasses.asdict(n) for n in reply.nodes]
    if not text_tokens:
        for node in listed:
            del node["text"]
    return {"worker": worker, "nodes": listed, "num_nodes": reply.num_nodes,
            "cached_pages": reply.cached_pages, "live": _live(reply),
            "prompt_text": text_tokens > 0}  # fmt: skip


async def requests(request: Request) -> dict[str, Any]:
    gw = gateway_of(request, "admin")
    limit = int_param(request, "limit", 100, 1, MAX_LISTED_REQUESTS)
    return {"requests": gw.requests.recent(limit, caller(request))}


async def autoscaler(request: Request) -> dict[str, Any]:
    gw = gateway_of(request, "admin")
    url = gw.settings.autoscaler_url
    if url is None:
        return {"autoscaler": None}
    body: dict[str, Any] = {"url": url}
    try:
        async with httpx.AsyncClient(timeout=AUTOSCALER_TIMEOUT_S) as http:
            resp = await http.get(f"{url.rstrip('/')}/health")
        health = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        body["error"] = f"cannot read {url}/health: {exc}"
        return {"autoscaler": body}
    body.update(status=health.get("status"), connector=health.get("connector"),
                latest=health.get("decisions", []),
                recent=health.get("recent_decisions", []))  # fmt: skip
    return {"autoscaler": body}
