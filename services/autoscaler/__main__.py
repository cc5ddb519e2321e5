"""``python -m radixserve.services.autoscaler``: the autoscaler alone, configured from the
environment (``RADIXSERVE_AUTOSCALER_*``)."""

from __future__ import annotations

import sys

from radixserve.logging import setup_logging


def main() -> int:
    from radixserve.runtime.service import serve_until_signalled
    from radixserve.services.autoscaler import AutoscalerService, AutoscalerSettings

    setup_logging()
    return serve_until_signalled(AutoscalerService(AutoscalerSettings()).run)


if __name__ == "__main__":
    sys.exit(main())
