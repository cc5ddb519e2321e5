"""``python -m radixserve.services.decode``: one decode worker, configured from the
environment (``RADIXSERVE_*`` for the engine, ``RADIXSERVE_DECODE_*`` for the worker)."""

from __future__ import annotations

import sys

from radixserve.logging import setup_logging
from radixserve.runtime.worker import run_worker
from radixserve.services.decode import DecodeSettings, DecodeWorker

if __name__ == "__main__":
    setup_logging()
    sys.exit(run_worker(DecodeWorker, DecodeSettings()))
