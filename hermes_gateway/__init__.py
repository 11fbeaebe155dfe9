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
    HermesError,
    IdempotencyConflict,
    InvalidArgs,
    NoWorkers,
    PermissionDenied,
    QueueFull,
    ToolTimeout,
    UnknownTool,
)
from broker.events import Event
from broker.toolspec import ToolSpec
from hermes_gateway.client import Gateway
from hermes_gateway.handle import CallHandle

__version__ = "0.10.0"

__all__ = [
    "BrokerNotDurable",
    "BrokerUnavailable",
    "CallCancelled",
    "CallFailed",
    "CallHandle",
    "CallTimeout",
    "CircuitOpen",
    "Event",
    "ExecutorError",
    "Gateway",
    "HermesError",
    "IdempotencyConflict",
    "InvalidArgs",
    "NoWorkers",
    "PermissionDenied",
    "QueueFull",
    "ToolSpec",
    "ToolTimeout",
    "UnknownTool",
]
