"""structlog set-up: human-readable by default, JSON lines with ``--log-format json``."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_extra_processors: list[Any] = []


def add_processor(proc: Any) -> None:
    """Let later layers (redaction) add a processor before rendering."""
    if proc not in _extra_processors:
        _extra_processors.append(proc)


def configure(level: str = "INFO", fmt: str = "console", stream: Any = None) -> None:
    """Configure structlog and stdlib logging once per process."""
    lvl = getattr(logging, str(level).upper(), logging.INFO)
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *_extra_processors,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=stream or sys.stderr)
