"""Fail-open reporting: the first failure of a kind warns, identical repeats go to DEBUG."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from .logger import get_logger

log = get_logger()


def callback_label(callback: Any) -> str:
    """A stable, readable name for a callback: ``module.qualname``."""
    module = getattr(callback, "__module__", None) or ""
    name = getattr(callback, "__qualname__", None) or getattr(callback, "__name__", None) or repr(callback)
    return f"{module}.{name}" if module else str(name)


class FailureReporter:
    """Logs a failing callback once at WARNING per (where, callback, error); repeats at DEBUG.

    A middleware whose signature names a field the gateway does not send fails identically on
    every call; without this it would flood the log. ``reset()`` is called on plugin reload.
    """

    def __init__(self) -> None:
        self._seen: set[tuple[str, int, str, str]] = set()
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget every reported failure, so the next one warns again."""
        with self._lock:
            self._seen.clear()

    def report(
        self,
        where: str,
        callback: Any,
        exc: BaseException,
        given: Iterable[str],
        *,
        plugin: str | None = None,
        phase: str = "",
    ) -> bool:
        """Log one failure; return True when it was the WARNING (first) occurrence."""
        label = callback_label(callback)
        # Keyed on the callback object: two closures of one factory share a label, not a report.
        key = (where, id(callback), type(exc).__name__, str(exc))
        with self._lock:
            first = key not in self._seen
            self._seen.add(key)
        fields = sorted(given)
        event = (
            f"{where} callback {label} raised {type(exc).__name__}: {exc}; it is given: {', '.join(fields)}"
        )
        info: dict[str, Any] = {
            "where": where,
            "callback": label,
            "plugin": plugin,
            "phase": phase,
            "error_type": type(exc).__name__,
            "error": str(exc),
            "fields_given": fields,
            "repeated": not first,
        }
        if first:
            log.warning(event, exc_info=exc, **info)
        else:
            log.debug(event, **info)
        return first
