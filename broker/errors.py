"""One exception tree for the whole gateway.

Every error that can end a call has a stable ``type`` code: it travels on the wire as
``{"type": ..., "message": ...}`` and the client turns it back into the same class.
"""

from __future__ import annotations

from typing import Any

WIRE_TEXT = 16 * 1024  # characters of an error's message (and of each detail string) that travel
_BY_TYPE: dict[str, type[CallFailed]] = {}  # wire type -> its CallFailed class (error_from_wire)


class HermesError(Exception):
    """Base of every error the gateway raises on purpose."""

    type: str = "error"
    retryable: bool = False
    masked: bool = True  # secret-shaped text in the message is masked on the wire

    def __init__(self, message: str = "", **details: Any) -> None:
        self.message = message or self.__class__.__doc__ or self.type
        super().__init__(self.message)
        self.details = details

    def to_wire(self) -> dict[str, Any]:
        """The error as it travels (events, records, HTTP): secret-shaped text masked (a message may quote
        what a caller sent) and very long text cut."""
        from broker.logs import clip_text, redact

        message = clip_text(self.message, WIRE_TEXT) if self.masked else self.message[:WIRE_TEXT]
        out: dict[str, Any] = {"type": self.type, "message": message}
        if self.details:
            out["details"] = redact(self.details, max_text=WIRE_TEXT)
        return out

    def __str__(self) -> str:
        return self.message


# --- configuration and connection -------------------------------------------------------------


class ConfigError(HermesError):
    """The configuration is invalid."""

    type = "config_error"


class BrokerUnavailable(HermesError):
    """No Redis broker could be reached or started."""

    type = "broker_unavailable"


class BrokerFull(HermesError):
    """Redis is out of memory (``maxmemory``): new calls are refused until memory is freed.

    Calls already accepted still run and end (their scripts may run at maxmemory), and an ended call frees
    most of its memory at once; the rest goes after ``workers.result_ttl``.
    """

    type = "broker_full"
    retryable = True


class BrokerNotDurable(HermesError):
    """A submission was not confirmed on ``broker.wait_replicas`` replicas within ``broker.wait_timeout_ms``.

    The call is not accepted: it was cancelled (``details["cancelled"]``) unless a worker had already
    finished it; ``details``: ``call_id`` (or ``call_ids``), ``replicas`` (how many confirmed), ``wanted``.
    """

    type = "broker_not_durable"
    retryable = True


# --- the wire ---------------------------------------------------------------------------------


class DecodeError(HermesError):
    """A payload could not be decoded."""

    type = "bad_payload"


class IllegalTransition(HermesError):
    """A call was asked to move between two states the state machine does not connect."""

    type = "illegal_transition"


# --- submission (raised at once in the caller) ----------------------------------------------


class UnknownTool(HermesError):
    """The tool is not in the directory."""

    type = "unknown_tool"


class InvalidSpec(HermesError):
    """A tool spec does not validate."""

    # Its message names the spec's own key paths (``headers.Authorization: ${TOKEN} is not set``), which
    # the header-shaped secret pattern would mask; a spec keeps its secrets as ${VAR} references.
    masked = False

    type = "invalid_spec"

    @classmethod
    def at(cls, where: str, path: str, expected: str) -> InvalidSpec:
        """``where: path: expected``, the path also in the details: the field a YAML author edits."""
        return cls(f"{where}: {path}: {expected}", path=path)


class UnknownBatch(HermesError):
    """No batch of that id is on record (never made, or past its ``batch.ttl``)."""

    type = "unknown_batch"


class QueueFull(HermesError):
    """The waiting queue for this concurrency key is full."""

    type = "queue_full"


class TokensOverLimit(HermesError):
    """An LLM call's token estimate alone is more than its model's ``tokens_per_minute``: it could never be
    admitted. ``details``: ``key``, ``estimate``, ``limit``."""

    type = "tokens_over_limit"


class NoWorkers(HermesError):
    """No worker listens on the queue the call needs."""

    type = "no_workers"


class IdempotencyConflict(HermesError):
    """The idempotency key already belongs to a call of another tool, or with other arguments.

    ``details``: ``key``, the existing call's ``call_id``, its ``tool`` (tool name, or model of an LLM call)
    and ``kind``.
    """

    type = "idempotency_conflict"


# --- call outcomes (raised by CallHandle.result) --------------------------------------------


class CallFailed(HermesError):
    """A call ended in the ``failed`` state; ``type`` is the worker's error type."""

    type = "remote_error"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Each typed call failure (one naming its own ``type``) is what ``error_from_wire`` rebuilds for it."""
        super().__init_subclass__(**kwargs)
        if "type" in cls.__dict__:
            _BY_TYPE[cls.type] = cls

    def __init__(self, message: str = "", *, error_type: str | None = None, **details: Any) -> None:
        super().__init__(message, **details)
        if error_type:
            self.type = error_type

    @property
    def error_type(self) -> str:
        return self.type


class InvalidArgs(CallFailed):
    """The arguments do not match the tool's input schema."""

    type = "invalid_args"


class PermissionDenied(CallFailed):
    """The principal may not call this tool."""

    type = "permission_denied"


class CircuitOpen(CallFailed):
    """The tool's circuit breaker is open."""

    type = "circuit_open"


class ExecutorError(CallFailed):
    """The back end behind the tool failed."""

    type = "executor_error"
    retryable = True


class ToolTimeout(CallFailed):
    """The tool ran past its timeout and was stopped."""

    type = "tool_timeout"
    retryable = True


class OutputTooLarge(CallFailed):
    """The tool's output passed the size cap."""

    type = "output_too_large"


class WorkerLost(CallFailed):
    """The worker running the call died and the call ran out of attempts."""

    type = "worker_lost"


class CallCancelled(HermesError):
    """The call was cancelled."""

    type = "cancelled"


class GatewayClosed(HermesError):
    """This client was closed: it sends no more calls, and one it was waiting on goes on without it (its
    outcome can be read by id with another client)."""

    type = "gateway_closed"


class CallTimeout(HermesError):
    """Waiting for the call's result timed out (the call itself may still finish)."""

    type = "timeout"


def error_from_wire(data: dict[str, Any] | None) -> CallFailed:
    """Rebuild the typed error a worker reported; unknown types stay ``CallFailed`` with that type."""
    data = data or {}
    etype = str(data.get("type") or "remote_error")
    message = str(data.get("message") or etype)
    details = data.get("details") or {}
    cls = _BY_TYPE.get(etype, CallFailed)
    return cls(message, error_type=etype, **details)


# --- LLM providers ----------------------------------------------------------------------------


class ProviderError(ExecutorError):
    """The LLM provider failed or refused the request."""

    type = "provider_error"

    def __init__(
        self,
        message: str = "",
        *,
        status: int | None = None,
        retry_after: float | None = None,
        retryable: bool = True,
        error_type: str | None = None,
        **details: Any,
    ) -> None:
        # status/retry_after/retryable go into details too, so they survive the wire round trip.
        if status is not None:
            details["status"] = status
        if retry_after is not None:
            details["retry_after"] = retry_after
        details["retryable"] = retryable
        super().__init__(message, error_type=error_type, **details)
        self.status = status
        self.retry_after = retry_after
        self.retryable = retryable


class BudgetExceeded(CallFailed):
    """The principal has spent its ``policy.principals.<p>.daily_tokens`` for today (UTC).
    ``details``: ``principal``, ``used``, ``budget``."""

    type = "budget_exceeded"


class ProviderTimeout(ToolTimeout):
    """The LLM provider did not answer within the call's timeout."""

    type = "provider_timeout"


class InvalidOutput(CallFailed):
    """The tool's result does not match its output schema."""

    type = "invalid_output"


class DestinationBlocked(CallFailed):
    """The SSRF guard refused the address a tool tried to reach (private, loopback, metadata, ...)."""

    type = "destination_blocked"


class ReplayRefused(HermesError):
    """An audited call cannot be replayed as asked (redacted args not supplied, a hash that does not match)."""

    type = "replay_refused"


class FlowError(HermesError):
    """A flow document is invalid, or one of its expressions cannot be evaluated."""

    type = "flow_error"
