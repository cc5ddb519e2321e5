"""``python -m radixserve.services.kvstore``: the kvstore alone, configured from the
environment (``RADIXSERVE_KVSTORE_*``)."""

from __future__ import annotations

import sys

from radixserve.logging import setup_logging
from radixserve.runtime.service import serve_until_signalled
from radixserve.services.kvstore import KVStoreService, KVStoreSettings

if __name__ == "__main__":
    setup_logging()
    service = KVStoreService(KVStoreSettings())
    sys.exit(serve_until_signalled(service.run, service.begin_drain))
