"""The operator's live view of the cluster: GET /explorer and its JSON under /debug/explorer.

The page (``static/explorer.*``, plain HTML, CSS and JS served as one document, no build
step) polls four endpoints and draws what they return:

* ``/debug/explorer/workers``: every worker's role, state, TP size and pages (device;
  the kvstore's host and disk tiers), its hit rate over the requests this gateway
  finished in the last minutes (`RequestLog.hit_rates`), its live requests and their
  phase (each worker's answer to a `CacheTreeQuery` asking for no nodes), and the cache
  audit's counters where a worker reports them;
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

from radixserve.protocol.messages import MAX_TREE_NODES, CacheTreeReply
from radixserve.runtime.engine_client import LOCAL_WORKER
from radixserve.services.gateway.gateway import Gateway, caller, gateway_of
from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.services.gateway.server.query import int_param

TEXT_TOKENS = 12  # a node's first tokens shown as text (with explorer_prompt_text)
DEFAULT_NODES = 48
MAX_LISTED_REQUESTS = 1000
AUTOSCALER_TIMEOUT_S = 1.0
#: what each worker's heartbeat stats may say, grouped for the page
DEVICE_KEYS = ("pages_total", "pages_used", "pages_free", "pages_cached", "pages_locked",
               "pages_evictable", "page_bytes", "live_requests")  # fmt: skip
LOAD_KEYS = ("running", "waiting", "queued_tokens", "gateway_in_flight")
AUDIT_KEYS = ("audit_checked", "audit_mismatches", "audit_fail_closed")
TIERS = ("host", "disk")  # the kvstore's tiers: <tier>_pages_{total,used,stored,leased}


@cache
def page_html() -> str:
    """The page: its HTML with its stylesheet and script inlined (one authorized GET)."""
    folder = resources.files("radixserve.services.gateway") / "static"
    html = (folder / "explorer.html").read_text(encoding="utf-8")
    css = (folder / "explorer.css").read_text(encoding="utf-8")
    js = (folder / "explorer.js").read_text(encoding="utf-8")
    return html.replace("/*EXPLORER_CSS*/", css).replace("/*EXPLORER_JS*/", js)


def _state(stats: dict[str, Any]) -> str:
    if not stats.get("up"):
        return "down"
    return "draining" if stats.get("draining") else "up"


def _tiers(stats: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The pages of each tier the worker reports: its own device pool, and (the kvstore)
    its host-memory and disk tiers."""
    tiers: dict[str, dict[str, Any]] = {}
    if "pages_total" in stats:
        tiers["device"] = {k: stats[k] for k in DEVICE_KEYS if k in stats}
    for tier in TIERS:
        prefix = f"{tier}_pages_"
        found = {k[len(prefix) :]: v for k, v in stats.items()
                 if k.startswith(prefix) and ":" not in k}  # fmt: skip
        if found:
            tiers[tier] = found
    return tiers


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


def _workers(gw: Gateway) -> dict[str, dict[str, Any]]:
    workers = gw.client.worker_stats()
    if workers:
        return workers
    return {LOCAL_WORKER: {"role": "engine", "up": True, **gw.client.stats()}}


async def workers(request: Request) -> dict[str, Any]:
    gw = gateway_of(request, "admin")
    found = _workers(gw)
    rates = gw.requests.hit_rates()
    names = [n for n, w in found.items() if w.get("up") and w.get("role") != "kvstore"]
    replies = await asyncio.gather(*(gw.client.cache_tree(n, 0, 0) for n in names))
    live = dict(zip(names, replies))
    listed = []
    for name, stats in sorted(found.items(), key=lambda kv: (str(kv[1].get("role")), kv[0])):
        listed.append({
            "name": name, "role": stats.get("role", ""), "state": _state(stats),
            "address": stats.get("address", ""), "tp_size": stats.get("tp_size", 1),
            "tiers": _tiers(stats), "load": {k: stats[k] for k in LOAD_KEYS if k in stats},
            "hit_rate": rates.get(name), "live": _live(live.get(name)),
            "audit": {k: stats[k] for k in AUDIT_KEYS if k in stats},
        })  # fmt: skip
    return {"workers": listed, "hit_rate": rates.get(""), "gateway_in_flight": gw.in_flight,
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
