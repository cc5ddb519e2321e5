"""The operator's status routes: GET /health (ready: a decode worker, or the in-process
engine, can serve), GET /live, GET /metrics, GET /debug/cache (the cache and admission
view, admin keys only) and POST /debug/cache/audit/clear."""

from __future__ import annotations

from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from radixserve.metrics import CONTENT_TYPE
from radixserve.model.identity import identity_card
from radixserve.services.gateway.gateway import gateway_of


async def health(request: Request) -> JSONResponse:
    gw = gateway_of(request, "none")
    ok, detail = gw.client.health()
    body = {"status": "ok" if ok else "unavailable", "model": gw.model_name, **detail}
    return JSONResponse(body, status_code=200 if ok else 503)


async def live() -> dict[str, str]:
    return {"status": "alive"}


async def metrics_text(request: Request) -> Response:
    gw = gateway_of(request, "none")
    body = gw.metrics.render(gw.client.stats(), gw.client.worker_stats())
    return Response(body, media_type=CONTENT_TYPE)


async def debug_cache(request: Request) -> dict[str, Any]:
    gw = gateway_of(request, "admin")
    body: dict[str, Any] = {
        **gw.client.stats(),
        "gateway_in_flight": gw.admission.requests,  # sequences (prompts x choices)
        "gateway_admission": gw.admission.snapshot(),  # names tenants: admins only
        "cache_namespace": gw.client.model_name,  # the checkpoint's own name
        "model_identity": identity_card(gw.client.identity),
    }
    workers = gw.client.worker_stats()
    if workers:
        body["workers"] = {name: view.as_dict() for name, view in workers.items()}
    return body


async def clear_cache_audit(request: Request) -> dict[str, Any]:
    """POST /debug/cache/audit/clear: the operator's all-clear after a failed-closed
    cache audit; every engine drops its cached pages and serves from its cache
    again. Answers each worker's name -> whether it had failed closed (null: no
    answer in time)."""
    gw = gateway_of(request, "admin")
    return {"workers": await gw.client.clear_cache_audit()}
