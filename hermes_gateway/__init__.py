"""Hermes Gateway: a distributed execution backend for AI agents."""

from __future__ import annotations

from broker.errors import (
    BrokerNotDurable,
    BrokerUnavailable,
    CallCancelled,
    CallFailed,
    CallTimeout,
    CircuitOpen,
    ExecutorError,
    GatewayClosed,
    HermesError,
    IdempotencyConflict,
    InvalidArgs,
    NoWorkers,
    PermissionDenied,
    QueueFull,
    ToolTimeout,
    UnknownBatch,
    UnknownTool,
    WorkerLost,
)
from broker.events import Event
from broker.toolspec import ToolSpec
from hermes_gateway.client import Gateway
from hermes_gateway.handle import CallHandle

__version__ = "0.10.0"


def __getattr__(name: str) -> object:
    """``AsyncGateway`` on first use: the asyncio client (redis.asyncio) is not loaded by ``import hermes_gateway``."""
    if name == "AsyncGateway":
        from hermes_gateway.aio import AsyncGateway

        return AsyncGateway
    raise AttributeError(f"module 'hermes_gateway' has no attribute {name!r}")


__all__ = [
    "AsyncGateway", "BrokerNotDurable", "BrokerUnavailable", "CallCancelled", "CallFailed", "CallHandle",
    "CallTimeout", "CircuitOpen", "Event", "ExecutorError", "Gateway", "GatewayClosed", "HermesError", "IdempotencyConflict",
    "InvalidArgs", "NoWorkers", "PermissionDenied", "QueueFull", "ToolSpec", "ToolTimeout", "UnknownBatch",
    "UnknownTool", "WorkerLost",
]
