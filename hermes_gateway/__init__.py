"""Hermes Gateway: a distributed execution backend for AI agents."""

from __future__ import annotations

from broker.errors import (
    BrokerFull,
    BrokerNotDurable,
    BrokerUnavailable,
    BudgetExceeded,
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
    OutputTooLarge,
    PermissionDenied,
    QueueFull,
    TokensOverLimit,
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
    "AsyncGateway", "BrokerFull", "BrokerNotDurable", "BrokerUnavailable", "BudgetExceeded", "CallCancelled",
    "CallFailed", "CallHandle", "CallTimeout", "CircuitOpen", "Event", "ExecutorError", "Gateway", "GatewayClosed",
    "HermesError", "IdempotencyConflict", "InvalidArgs", "NoWorkers", "OutputTooLarge", "PermissionDenied",
    "QueueFull", "TokensOverLimit", "ToolSpec", "ToolTimeout", "UnknownBatch", "UnknownTool", "WorkerLost",
]
