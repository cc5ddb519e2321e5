"""The OpenAI-compatible HTTP gateway (installed as ``radixserve.services.gateway``).

`create_app(client, settings)` builds the FastAPI app over an `EngineClient`:
`LocalEngineClient` runs the engine in-process, `ClusterClient` serves through decode
workers; `build_client` picks by settings. In cluster mode the gateway loads only the
model's config and tokenizer: neither torch nor the engine is imported. See `routes` for the endpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.launch.listeners import adopt
from radixserve.runtime.engine_client import EngineClient, LocalEngineClient
from radixserve.services.gateway.routes import create_app
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
    of ``settings.kvstore``, if either is set (only the tokenizer is loaded here; the
    workers' model identity is learned from them, `ClusterClient.root_namespace`), else
    an in-process engine built from ``engine_settings``."""
    if settings.decode_workers or settings.kvstore_list():
        from radixserve.model.model_files import open_model
        from radixserve.runtime.routing.cluster_client import ClusterClient

        model = open_model(engine_settings.model)  # config and tokenizer, no weights
        # the page-hash namespace (model identity and cache salt) is the workers': the
        # first one's HelloAck sets it (their weights and resolved dtype are not read here)
        return ClusterClient(
            settings, model.tokenizer, model.config.name,
            model.config.max_model_len(engine_settings.max_model_len),
            engine_settings.page_size, None, model.served_name,
        )  # fmt: skip
    from radixserve.engine.async_engine import AsyncEngine

    return LocalEngineClient(AsyncEngine(engine_settings))  # built on its thread


def serve(client: EngineClient, settings: GatewaySettings) -> None:
    """Run the gateway over `client` with uvicorn until interrupted, then close `client`
    (the server's connection limits: `server.http_server`)."""
    import uvicorn

    from radixserve.services.gateway.server.http_server import server_config

    try:
        settings.require_secure()  # no unauthenticated gateway beyond loopback
        app = create_app(client, settings)
        config = server_config(app, settings, app.state.gateway.metrics)
        # on the listening socket radixserve up's supervisor bound for the gateway, if any
        inherited = None if settings.listen_fd is None else [adopt(settings.listen_fd)]
        uvicorn.Server(config).run(sockets=inherited)
    finally:
        client.close()
