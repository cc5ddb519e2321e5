"""``python -m radixserve.services.gateway``: an in-process engine behind the gateway.

Configured from the environment only: engine settings as ``RADIXSERVE_*``, gateway
settings as ``RADIXSERVE_GATEWAY_*``.
"""

from __future__ import annotations

import logging
import sys

from radixserve.logging import setup_logging

logger = logging.getLogger(__name__)


def main() -> int:
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.engine.engine import Engine
    from radixserve.services.gateway import GatewaySettings, LocalEngineClient, serve
    from radixserve.settings import EngineSettings

    setup_logging()
    from_env: dict[str, object] = {}  # every field from RADIXSERVE_* / defaults
    gateway_settings = GatewaySettings(**from_env)  # type: ignore[arg-type]
    client = LocalEngineClient(AsyncEngine(Engine(EngineSettings(**from_env))))  # type: ignore[arg-type]
    print(f"radixserve gateway on http://{gateway_settings.host}:{gateway_settings.port}/v1")
    sys.stdout.flush()
    serve(client, gateway_settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
