"""/openapi.json: FastAPI's schema, with the request bodies the handlers really read.

The generation handlers read the body themselves (size limit, UTF-8 and JSON checks
first), so FastAPI cannot see their models; `body` names a model as a route's request
body and `install_openapi` adds those models (and what they reference) to the schema's
components, so clients and fuzzers see the real bodies with their bounds.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

_REF = "#/components/schemas/{model}"


class DocModel(BaseModel):
    """A response body's model, for /openapi.json (and the tests' checks) only: the
    handlers build plain dicts."""

    model_config = ConfigDict(extra="forbid")


_BODIES: dict[str, type[BaseModel]] = {}


def body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` declaring ``model`` as a route's JSON request body."""
    _BODIES[model.__name__] = model
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI) -> None:
    """Build the schema once, on first request of /openapi.json."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, model in _BODIES.items():
            js = model.model_json_schema(ref_template=_REF, mode="validation")
            for sub, definition in js.pop("$defs", {}).items():
                components.setdefault(sub, definition)
            components[name] = js
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
