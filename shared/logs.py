"""structlog set-up shared by every service: one JSON object per line on stderr."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(service: str, level: str | None = None) -> structlog.stdlib.BoundLogger:
    level_name = (level or os.environ.get("MUSTER_LOG_LEVEL", "INFO")).upper()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(service=service)
    return logger
