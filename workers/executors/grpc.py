"""The ``grpc`` executor: unary and server-streaming calls described by server reflection, JSON in and out.

A server stream's messages come back as a list, announced as progress while it runs; client-streaming
methods are refused. gRPC status codes become typed errors (``_translate``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from broker.errors import (
    CallCancelled,
    ExecutorError,
    HermesError,
    InvalidArgs,
    InvalidSpec,
    OutputTooLarge,
    ToolTimeout,
)
from broker.toolspec import ToolSpec

from . import DEFAULT_MAX_OUTPUT, POLL, ExecContext, PerProcess, from_env, require

if TYPE_CHECKING:  # grpc and protobuf are imported where a call runs, not where a spec registers
    import grpc

STREAM_PROGRESS_EVERY = 0.1  # seconds between progress events of a response stream
_RETRYABLE = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "ABORTED", "INTERNAL"}  # status code names


def split_method(name: str) -> tuple[str, str] | None:
    """``package.Service/Method`` (or ``package.Service.Method``) as (service, method), or None."""
    service, sep, method = name.rpartition("/")
    if not sep:
        service, _, method = name.rpartition(".")
    return (service, method) if service and method else None


class _Target:
    """A channel to one server plus the descriptor pool its reflection service fills lazily."""

    def __init__(self, address: str, tls: bool) -> None:
        import grpc
        from google.protobuf import descriptor_pool
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase,
        )

        options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        if tls:
            self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(), options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(self.channel))
        self.methods: dict[str, tuple[Any, Any, bool]] = {}
        self.lock = threading.Lock()

    def close(self) -> None:
        self.channel.close()

    def method(self, name: str, where: str) -> tuple[Any, Any, bool]:
        """(callable, request class, whether it streams its responses) for ``package.Service/Method``."""
        if (found := self.methods.get(name)) is not None:
            return found
        if (split := split_method(name)) is None:
            raise InvalidSpec.at(where, "method", f"expected 'package.Service/Method', got {name!r}")
        service, method = split
        from google.protobuf import message_factory

        with self.lock:
            try:
                desc = self.pool.FindServiceByName(service).FindMethodByName(method)
            except KeyError:
                desc = None
            if desc is None:
                raise ExecutorError(f"{where}: the server does not offer {service}/{method} (via reflection)")
            if desc.client_streaming:
                raise InvalidSpec(
                    f"{where}: {service}/{method} streams its requests; only unary and server-streaming "
                    "methods can be called"
                )
            request = message_factory.GetMessageClass(desc.input_type)
            response = message_factory.GetMessageClass(desc.output_type)
            make = self.channel.unary_stream if desc.server_streaming else self.channel.unary_unary
            call = make(
                f"/{service}/{method}",
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            )
            self.methods[name] = (call, request, desc.server_streaming)
        return self.methods[name]


class GrpcExecutor:
    """One channel per target, shared by all worker threads (gRPC channels are thread-safe)."""

    keys = frozenset({"target", "tls", "method", "metadata", "max_output"})

    @staticmethod
    def check(where: str, data: Mapping[str, Any]) -> None:
        require(where, "grpc", data, ("method",), "package.Service/Method")
        method = data["method"]
        if not from_env(method) and (not isinstance(method, str) or split_method(method) is None):
            raise InvalidSpec.at(where, "method", f"expected 'package.Service/Method', got {method!r}")
        if data.get("metadata") is not None and not isinstance(data["metadata"], dict):
            raise InvalidSpec.at(where, "metadata", "expected a mapping of metadata key to value")

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self._targets: PerProcess[tuple[str, bool], _Target] = PerProcess()

    def _describe(self, target: _Target, key: tuple[str, bool], name: str, where: str, ctx: ExecContext) -> Any:
        """``target.method`` within the call's deadline and cancel: the reflection stream has no deadline
        of its own, so a server that never answers it held the call (and the target's lock) for ever. On
        giving up, the target's channel closes (ending the stream) and the next call opens a new one."""
        found: list[Any] = []

        def describe() -> None:
            try:
                found.append(target.method(name, where))
            except BaseException as e:  # noqa: BLE001 - handed to the call's thread
                found.append(e)

        thread = threading.Thread(target=describe, name="hermes-grpc-reflection", daemon=True)
        thread.start()
        while not found:
            thread.join(POLL)
            if not found and (ctx.cancelled.is_set() or time.monotonic() >= ctx.deadline):
                self._targets.forget(key, target)
                target.close()
                ctx.check()
        if isinstance(found[0], BaseException):
            raise found[0]
        return found[0]

    def run(self, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext) -> Any:
        import grpc
        from google.protobuf import json_format

        config = {**self.settings, **spec.config}
        where = f"tool {spec.name!r}"
        address = config.get("target")
        if not isinstance(address, str) or not address:
            raise InvalidSpec.at(where, "target", "expected host:port")
        name = config.get("method")
        if not isinstance(name, str):
            raise InvalidSpec.at(where, "method", "expected 'package.Service/Method'")
        max_output = int(config.get("max_output", DEFAULT_MAX_OUTPUT))
        metadata = [(str(k).lower(), str(v)) for k, v in (config.get("metadata") or {}).items()]
        metadata.extend(ctx.trace_headers().items())
        ctx.check()
        tls = bool(config.get("tls", False))
        key = (address, tls)
        target = self._targets.get(key, lambda: _Target(address, tls))
        try:
            call, request_cls, streams = target.methods.get(name) or self._describe(target, key, name, where, ctx)
        except HermesError:
            raise
        except grpc.RpcError as e:
            raise _translate(e, ctx, where) from e
        except Exception as e:  # noqa: BLE001 - reflection failures (server down, no reflection) fail the call
            raise ExecutorError(f"{where}: cannot describe {name} via reflection at {address}: {e}") from e
        try:
            request = json_format.ParseDict(args, request_cls())
        except json_format.ParseError as e:
            raise InvalidArgs(f"{where}: arguments do not fit {request_cls.DESCRIPTOR.full_name}: {e}") from e
        if streams:
            return _stream(call(request, timeout=ctx.remaining(), metadata=metadata or None), ctx, where, max_output)
        future = call.future(request, timeout=ctx.remaining(), metadata=metadata or None)
        while True:
            try:
                response = future.result(timeout=POLL)
                break
            except grpc.FutureTimeoutError:
                if ctx.cancelled.is_set():
                    future.cancel()
                    raise CallCancelled(f"call {ctx.call_id} was cancelled") from None
            except grpc.RpcError as e:
                raise _translate(e, ctx, where) from e
            except grpc.FutureCancelledError as e:
                raise CallCancelled(f"call {ctx.call_id} was cancelled") from e
        ctx.status_code = grpc.StatusCode.OK.name
        size = response.ByteSize()
        if size > max_output:
            raise OutputTooLarge(
                f"{where}: response of {size} bytes passes the cap of {max_output}", limit=max_output
            )
        ctx.progress(f"gRPC OK, {size} bytes")
        return json_format.MessageToDict(response, preserving_proto_field_name=True)

    def close(self) -> None:
        self._targets.close_all()


def _stream(responses: Any, ctx: ExecContext, where: str, max_output: int) -> list[dict[str, Any]]:
    """A server stream's messages as dicts, each announced as progress; cancelled with the call."""
    import grpc
    from google.protobuf import json_format

    ended = threading.Event()

    def watch() -> None:  # the iterator blocks between messages: a cancel reaches it from here
        while not ended.is_set():
            if ctx.cancelled.wait(POLL):
                responses.cancel()
                return

    threading.Thread(target=watch, name="hermes-grpc-stream", daemon=True).start()
    out: list[dict[str, Any]] = []
    total, told = 0, 0.0
    try:
        for message in responses:
            total += message.ByteSize()
            if total > max_output:
                responses.cancel()
                raise OutputTooLarge(
                    f"{where}: stream of {total} bytes passes the cap of {max_output}", limit=max_output
                )
            out.append(json_format.MessageToDict(message, preserving_proto_field_name=True))
            if time.monotonic() - told >= STREAM_PROGRESS_EVERY:  # a long stream: not an event per message
                told = time.monotonic()
                ctx.progress(f"gRPC stream: {len(out)} message(s), {total} bytes so far")
    except grpc.RpcError as e:
        raise _translate(e, ctx, where) from e
    finally:
        ended.set()
    if ctx.cancelled.is_set():
        raise CallCancelled(f"call {ctx.call_id} was cancelled")
    ctx.status_code = grpc.StatusCode.OK.name
    ctx.progress(f"gRPC stream ended: {len(out)} message(s), {total} bytes")
    return out


def _translate(e: grpc.RpcError, ctx: ExecContext, where: str) -> HermesError:
    import grpc

    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    ctx.status_code = code.name
    details = (e.details() if hasattr(e, "details") else str(e)) or code.name
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or (time.monotonic() >= ctx.deadline):
        return ToolTimeout(f"{where}: timed out after {ctx.timeout:g}s ({details})", status=code.name)
    if code == grpc.StatusCode.CANCELLED and ctx.cancelled.is_set():
        return CallCancelled(f"call {ctx.call_id} was cancelled")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgs(f"{where}: server rejected the arguments: {details}", status=code.name)
    retryable = code.name in _RETRYABLE
    err = ExecutorError(f"{where}: gRPC {code.name}: {details}", status=code.name, retryable=retryable)
    err.retryable = retryable
    return err

