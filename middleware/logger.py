"""The middleware package's logger: structlog where the process configured it, stdlib ``logging`` where not.

Our processes configure structlog (``broker.logs.configure``). A program that only imports this package
(as Hermes, which logs through ``logging.getLogger``) gets stdlib records on ``hermes.middleware`` instead
of unconfigured structlog's stdout: the fields travel in the record's ``hermes`` attribute.
"""

from __future__ import annotations

import logging
from functools import partialmethod
from typing import Any

import structlog

NAME = "hermes.middleware"


class MiddlewareLog:
    """``debug`` / ``info`` / ``warning`` taking an event and fields (``exc_info`` keeps a traceback)."""

    def __init__(self) -> None:
        self._structlog = structlog.get_logger(NAME)
        self._stdlib = logging.getLogger(NAME)

    def _emit(self, method: str, level: int, event: str, /, **fields: Any) -> None:
        if structlog.is_configured():
            getattr(self._structlog, method)(event, **fields)
        elif self._stdlib.isEnabledFor(level):
            exc_info = fields.pop("exc_info", False)
            self._stdlib.log(level, "%s", event, exc_info=exc_info, extra={"hermes": fields})

    debug = partialmethod(_emit, "debug", logging.DEBUG)
    info = partialmethod(_emit, "info", logging.INFO)
    warning = partialmethod(_emit, "warning", logging.WARNING)


def get_logger() -> MiddlewareLog:
    return MiddlewareLog()
