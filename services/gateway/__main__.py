"""``python -m radixserve.services.gateway``: the HTTP gateway as its own process.

Configured from the environment only: gateway settings as ``RADIXSERVE_GATEWAY_*``
and the model as ``RADIXSERVE_MODEL`` (the gateway reads its tokenizer and chat
template). With ``RADIXSERVE_GATEWAY_DECODE_WORKERS`` set it serves through those
workers; without, it runs an engine in-process (``RADIXSERVE_*`` engine settings).
"""

from __future__ import annotations

import sys
from typing import Any

from radixserve.logging import setup_logging


def main(overrides: dict[str, Any] | None = None) -> int:
    """Serve with the environment's settings (and ``overrides``: `radixserve gateway`'s
    flags)."""
    from radixserve.services.gateway import GatewaySettings, build_client, serve
    from radixserve.settings import EngineSettings

    setup_logging()
    from_env: dict[str, object] = {}  # every field from RADIXSERVE_* / defaults
    gateway_settings = GatewaySettings(**(overrides or {}))
    gateway_settings.require_secure()  # before the model's files are read
    client = build_client(gateway_settings, EngineSettings(**from_env))  # type: ignore[arg-type]
    if stores := gateway_settings.kvstore_list():
        mode = f"the workers of the cluster at {', '.join(stores)}"
    elif gateway_settings.decode_workers:
        mode = f"{len(gateway_settings.decode_workers)} decode worker(s)"
    else:
        mode = "an in-process engine"
    print(
        f"radixserve gateway on http://{gateway_settings.host}:{gateway_settings.port}/v1 "
        f"serving {client.model_name} through {mode}",
        flush=True,
    )
    serve(client, gateway_settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
