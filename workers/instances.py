"""One instance per key per process, made on first use and closed together at shutdown (executors by kind,
LLM providers by endpoint)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar


class Closable(Protocol):
    def close(self) -> None: ...


K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Closable)


class PerProcess(Generic[K, V]):
    def __init__(self) -> None:
        self.items: dict[K, V] = {}
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The instance of ``key``, made by ``make()`` the first time (once, under a lock)."""
        inst = self.items.get(key)
        if inst is not None:
            return inst
        with self._lock:
            inst = self.items.get(key)
            if inst is None:
                inst = self.items[key] = make()
        return inst

    def close_all(self) -> None:
        """Close every instance (best effort: at shutdown) and forget them."""
        with self._lock:
            for inst in self.items.values():
                try:
                    inst.close()
                except Exception:  # noqa: BLE001 - closing is best effort at shutdown
                    pass
            self.items.clear()
