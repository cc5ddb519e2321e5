"""Loading and unloading LoRA adapters at run time: vLLM's ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``.

Both need ``allow_runtime_lora`` (else 403 naming it) and, where API keys are configured,
an admin key (403 for a user key). A ``lora_path`` is confined to ``lora_dir``
(`lora_resolver.confined`): resolved with every symbolic link followed, then refused (403
naming it) unless it and every file in it lie inside. The engines load it (on a cluster,
every worker: `EngineClient.load_adapter`); what an engine refuses (a rank over
``max_lora_rank``, a missing file) is a 400 with its sentence. An unknown name to unload is
a 404; an adapter a request still uses is not unloaded (400). Once loaded, requests name
the adapter as their ``model`` and /v1/models lists it under the base model (``parent``).
With ``lora_load_on_demand``, a request naming ``<lora_dir>/<name>`` loads it the same way
first (`lora_resolver`).
"""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from radixserve.errors import ModelLoadError
from radixserve.services.gateway.gateway import Gateway, gateway_of
from radixserve.services.gateway.openai_api.fields import Body
from radixserve.services.gateway.openai_api.lora_resolver import confined
from radixserve.services.gateway.server.errors import OpenAIError

logger = logging.getLogger(__name__)


class LoadLoraAdapterRequest(Body):
    """`POST /v1/load_lora_adapter` (vLLM's shape)."""

    lora_name: str = Field(min_length=1, max_length=256, pattern=r"^[^=\s]+$")
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(Body):
    """`POST /v1/unload_lora_adapter` (vLLM's shape; ``lora_int_id`` is not taken)."""

    lora_name: str = Field(min_length=1, max_length=256)


def _runtime(request: Request) -> Gateway:
    """The gateway, its caller an admin, run-time loading allowed (403s otherwise)."""
    gw = gateway_of(request, "admin")
    if not gw.settings.allow_runtime_lora:
        raise OpenAIError(403, "loading and unloading LoRA adapters at run time is off "
                          "(allow_runtime_lora: RADIXSERVE_GATEWAY_ALLOW_RUNTIME_LORA=true, "
                          "with RADIXSERVE_GATEWAY_LORA_DIR)")  # fmt: skip
    return gw


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    gw = _runtime(request)
    req = LoadLoraAdapterRequest.model_validate(await gw.read_json(request))
    name = req.lora_name
    if name in (*gw.model_names, "default"):
        raise OpenAIError(400, f"lora_name {name!r} is the base model's id", "lora_name")
    assert gw.settings.lora_dir is not None  # allow_runtime_lora needs it
    path = confined(gw.settings.lora_dir, req.lora_path)
    try:
        info = await gw.client.load_adapter(name, str(path))
    except ModelLoadError as exc:
        raise OpenAIError(400, str(exc), "lora_path") from None
    logger.info("LoRA adapter %s loaded from %s (%s)", name, path, info.fingerprint[:19])
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    gw = _runtime(request)
    req = UnloadLoraAdapterRequest.model_validate(await gw.read_json(request))
    await gw.client.unload_adapter(req.lora_name)  # UnknownAdapterError: 404
    logger.info("LoRA adapter %s unloaded", req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
