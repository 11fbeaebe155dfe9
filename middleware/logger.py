"""The middleware package's logger: structlog where the process configured it, stdlib ``logging`` where not.

Our processes configure structlog (``broker.logs.configure``), so the lines carry their fields and follow
``--log-format``. A program that only imports this package (the way Hermes itself logs, through
``logging.getLogger``) gets ordinary stdlib records on the ``hermes.middleware`` logger instead of
structlog's unconfigured default, which prints to stdout: the fields travel in the record's ``hermes``
attribute, and a warning or an error keeps its traceback.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

NAME = "hermes.middleware"

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class MiddlewareLog:
    """``debug`` / ``info`` / ``warning`` / ``error`` / ``exception`` taking an event and fields."""

    def __init__(self, name: str = NAME) -> None:
        self.name = name
        self._structlog = structlog.get_logger(name)
        self._stdlib = logging.getLogger(name)

    def _emit(self, method: str, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            getattr(self._structlog, method)(event, **fields)
            return
        level = logging.ERROR if method == "exception" else _LEVELS[method]
        if not self._stdlib.isEnabledFor(level):
            return
        exc_info = fields.pop("exc_info", method == "exception")
        self._stdlib.log(level, "%s", event, exc_info=exc_info, extra={"hermes": fields})

    def debug(self, event: str, **fields: Any) -> None:
        self._emit("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit("error", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._emit("exception", event, fields)


def get_logger(name: str = NAME) -> MiddlewareLog:
    return MiddlewareLog(name)
