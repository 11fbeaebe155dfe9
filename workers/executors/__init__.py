"""Executors, one module per kind: its spec keys and registration checks on its class, and its run.

``EXECUTORS`` is the one table of kinds. A class is imported on first use, so registering a spec loads its
own executor's module only, and none of the libraries its run needs (those are imported in the run).
"""

from __future__ import annotations

import importlib
from typing import Any

from broker.errors import ConfigError
from workers.instances import PerProcess

from .base import Executor

EXECUTORS: dict[str, str] = {
    "http": "workers.executors.http:HttpExecutor",
    "command": "workers.executors.command:CommandExecutor",
    "mcp": "workers.executors.mcp:McpExecutor",
    "database": "workers.executors.database:DatabaseExecutor",
    "grpc": "workers.executors.grpc:GrpcExecutor",
    "python": "workers.executors.python:PythonExecutor",
}

_instances: PerProcess[str, Executor] = PerProcess()


def executor_class(kind: str) -> type[Executor]:
    """The class of the executor ``kind`` (ConfigError when there is none)."""
    if kind not in EXECUTORS:
        raise ConfigError(f"tool executor not found: {kind!r}")
    module, _, name = EXECUTORS[kind].partition(":")
    cls: type[Executor] = getattr(importlib.import_module(module), name)
    return cls


def get_executor(kind: str, settings: dict[str, Any] | None = None) -> Executor:
    """One executor instance per kind per process, created on first use."""
    return _instances.get(kind, lambda: executor_class(kind)(settings or {}))


def close_all() -> None:
    _instances.close_all()
