"""Log set-up for entry points (CLI, service __main__); library modules only get loggers."""

from __future__ import annotations

import logging
import os


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once: `level`, else $RADIXSERVE_LOG_LEVEL, else WARNING."""
    name = (level or os.environ.get("RADIXSERVE_LOG_LEVEL") or "WARNING").upper()
    logging.basicConfig(
        level=getattr(logging, name, logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
