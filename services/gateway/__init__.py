"""The OpenAI-compatible HTTP gateway (installed as ``radixserve.services.gateway``).

`create_app(client, settings)` builds the FastAPI app over an `EngineClient`:
`LocalEngineClient` runs the engine in-process, `ClusterClient` serves through decode
and prefill workers; `build_client` picks by settings. See `app` for the endpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.services.gateway.app import create_app
from radixserve.services.gateway.engine_client import EngineClient, LocalEngineClient
from radixserve.services.gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from radixserve.settings import EngineSettings

__all__ = [
    "EngineClient",
    "GatewaySettings",
    "LocalEngineClient",
    "build_client",
    "create_app",
    "serve",
]


def build_client(settings: GatewaySettings, engine_settings: EngineSettings) -> EngineClient:
    """A `ClusterClient` over ``settings.decode_workers`` and the members of the cluster
    of ``settings.kvstore``, if either is set (only the tokenizer is loaded here), else an
    in-process engine built from ``engine_settings``."""
    if settings.decode_workers or settings.kvstore:
        from radixserve.model.checkpoint import load_checkpoint, served_model_id
        from radixserve.services.gateway.cluster_client import ClusterClient

        checkpoint = load_checkpoint(engine_settings.model, progress=False)
        config = checkpoint.config
        limit = min(engine_settings.max_model_len or config.max_position_embeddings,
                    config.max_position_embeddings)  # fmt: skip
        return ClusterClient(
            settings, checkpoint.tokenizer, config.name, limit, engine_settings.page_size,
            served_model_id(engine_settings.model),
        )  # fmt: skip
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.engine.engine import Engine

    return LocalEngineClient(AsyncEngine(lambda: Engine(engine_settings)))  # on its thread


def serve(client: EngineClient, settings: GatewaySettings) -> None:
    """Run the gateway over `client` with uvicorn until interrupted, then close `client`."""
    import uvicorn

    app = create_app(client, settings)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
    finally:
        client.close()
