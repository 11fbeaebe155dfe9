"""Executors, one module per kind: its spec keys and registration checks on its class, and its run.

``EXECUTORS`` is the one table of kinds. A class is imported on first use, so registering a spec loads its
own executor's module only, and none of the libraries its run needs (those are imported in the run).
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from broker.errors import ConfigError

from .base import Executor

EXECUTORS: dict[str, str] = {
    "http": "workers.executors.http:HttpExecutor",
    "command": "workers.executors.command:CommandExecutor",
    "mcp": "workers.executors.mcp:McpExecutor",
    "database": "workers.executors.database:DatabaseExecutor",
    "grpc": "workers.executors.grpc:GrpcExecutor",
    "python": "workers.executors.python:PythonExecutor",
}

_instances: dict[str, Executor] = {}
_lock = threading.Lock()


def executor_class(kind: str) -> type[Executor]:
    """The class of the executor ``kind`` (ConfigError when there is none)."""
    if kind not in EXECUTORS:
        raise ConfigError(f"tool executor not found: {kind!r}")
    module, _, name = EXECUTORS[kind].partition(":")
    cls: type[Executor] = getattr(importlib.import_module(module), name)
    return cls


def get_executor(kind: str, settings: dict[str, Any] | None = None) -> Executor:
    """One executor instance per kind per process, created on first use."""
    inst = _instances.get(kind)
    if inst is not None:
        return inst
    with _lock:
        inst = _instances.get(kind)
        if inst is None:
            inst = _instances[kind] = executor_class(kind)(settings or {})
    return inst


def close_all() -> None:
    with _lock:
        for inst in _instances.values():
            try:
                inst.close()
            except Exception:  # noqa: BLE001 - closing is best effort at shutdown
                pass
        _instances.clear()
