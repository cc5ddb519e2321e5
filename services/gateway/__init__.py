"""The OpenAI-compatible HTTP gateway (installed as ``radixserve.services.gateway``).

`create_app(client, settings)` builds the FastAPI app over an `EngineClient`;
`LocalEngineClient` runs the engine in-process. See `app` for the endpoints.
"""

from radixserve.services.gateway.app import create_app
from radixserve.services.gateway.engine_client import EngineClient, LocalEngineClient
from radixserve.services.gateway.settings import GatewaySettings

__all__ = ["EngineClient", "GatewaySettings", "LocalEngineClient", "create_app", "serve"]


def serve(client: EngineClient, settings: GatewaySettings) -> None:
    """Run the gateway over `client` with uvicorn until interrupted, then close `client`."""
    import uvicorn

    app = create_app(client, settings)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
    finally:
        client.close()
