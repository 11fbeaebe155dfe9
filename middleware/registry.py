"""What plugins registered, and the immutable runtime snapshot built from it once per change."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from middleware.kinds import KINDS, VALID_HOOKS
from middleware.logger import get_logger
from middleware.reporter import FailureReporter, callback_label

if TYPE_CHECKING:
    from middleware.context import PluginContext
    from middleware.runtime import MiddlewareRuntime

log = get_logger()


@dataclass(frozen=True, slots=True)
class Registration:
    """One registered callback and the plugin that registered it (None when registered directly)."""

    name: str
    callback: Callable[..., Any]
    plugin: str | None = None


class MiddlewareRegistry:
    """Registered middleware and hooks; ``runtime()`` returns the snapshot calls should run through.

    Registration is rare and takes a lock; calls read an immutable snapshot with no lock at all.
    The snapshot (including the folded execution chains) is rebuilt only after a registration change.
    """

    def __init__(self, reporter: FailureReporter | None = None) -> None:
        self.reporter = reporter or FailureReporter()
        self._lock = threading.Lock()
        self._middleware: dict[str, list[Registration]] = {kind: [] for kind in KINDS}
        self._hooks: dict[str, list[Registration]] = {}
        self._runtime: MiddlewareRuntime | None = None

    def register_middleware(self, kind: str, callback: Callable[..., Any], plugin: str | None = None) -> bool:
        """Add ``callback`` for ``kind``; an unknown kind is warned about (naming the valid ones) and ignored."""
        if kind not in self._middleware:
            log.warning(
                f"plugin {plugin or '<direct>'} registered unknown middleware kind {kind!r}; "
                f"valid kinds: {', '.join(KINDS)}; ignored",
                plugin=plugin,
                kind=kind,
                valid=list(KINDS),
            )
            return False
        if not callable(callback):
            raise TypeError(f"middleware for {kind!r} must be callable, got {type(callback).__name__}")
        with self._lock:
            self._middleware[kind].append(Registration(kind, callback, plugin))
            self._runtime = None
        log.debug("middleware registered", kind=kind, plugin=plugin, callback=callback_label(callback))
        return True

    def register_hook(self, name: str, callback: Callable[..., Any], plugin: str | None = None) -> None:
        """Add an observer hook; unknown names are warned about but kept, as Hermes does."""
        if name not in VALID_HOOKS:
            log.warning(
                f"plugin {plugin or '<direct>'} registered unknown hook {name!r}; "
                f"valid hooks: {', '.join(sorted(VALID_HOOKS))}",
                plugin=plugin,
                hook=name,
            )
        if not callable(callback):
            raise TypeError(f"hook {name!r} must be callable, got {type(callback).__name__}")
        with self._lock:
            self._hooks.setdefault(name, []).append(Registration(name, callback, plugin))
            self._runtime = None

    def context(self, plugin: str, manifest: Any = None) -> PluginContext:
        """The ``ctx`` handed to a plugin's ``register(ctx)``."""
        from middleware.context import PluginContext

        return PluginContext(self, plugin, manifest)

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """How many middleware per kind and callbacks per hook are registered (for attribution)."""
        with self._lock:
            return (
                {kind: len(regs) for kind, regs in self._middleware.items()},
                {name: len(regs) for name, regs in self._hooks.items()},
            )

    def runtime(self) -> MiddlewareRuntime:
        """The current immutable snapshot; cheap when nothing changed since the last call."""
        snapshot = self._runtime
        if snapshot is not None:
            return snapshot
        from middleware.runtime import MiddlewareRuntime

        with self._lock:
            if self._runtime is None:
                self._runtime = MiddlewareRuntime(
                    {kind: tuple(regs) for kind, regs in self._middleware.items()},
                    {name: tuple(regs) for name, regs in self._hooks.items() if regs},
                    self.reporter,
                )
            return self._runtime
