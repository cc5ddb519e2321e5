"""Query parameters of the gateway's GET routes, read by hand (not declared as FastAPI
parameters, so /openapi.json documents no 422): a bad or unknown one is a 400 in
OpenAI's error shape that names it."""

from __future__ import annotations

from fastapi import Request

from radixserve.services.gateway.server.errors import OpenAIError


def only_params(request: Request, accepted: tuple[str, ...], where: str) -> None:
    """Refuse, by name, any query parameter of ``request`` not in ``accepted``."""
    for name in request.query_params:
        if name not in accepted:
            raise OpenAIError(400, f"{name} is not a parameter of {where} (accepted: "
                              f"{', '.join(accepted)})", name)  # fmt: skip


def int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    """The integer query parameter ``name`` in [lo, hi] (``default`` when absent)."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise OpenAIError(400, f"{name} must be an integer from {lo} to {hi}, got {raw[:32]!r}",
                          name)  # fmt: skip
    return int(raw)
