"""``python -m radixserve.services.autoscaler``: the autoscaler alone, configured from the
environment (``RADIXSERVE_AUTOSCALER_*``)."""

from __future__ import annotations

import sys

from radixserve.logging import setup_logging


def main() -> int:
    from radixserve.services.autoscaler import AutoscalerSettings, serve_autoscaler

    setup_logging()
    return serve_autoscaler(AutoscalerSettings())


if __name__ == "__main__":
    sys.exit(main())
