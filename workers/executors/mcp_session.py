"""MCP sessions for the ``mcp`` executor and ``mcp add``: one live ``mcp.Client`` per server, held open by
its own task on a private event loop, and the SDK's failures turned into typed errors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import subprocess
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from math import inf
from typing import Any

import anyio

from broker.errors import ExecutorError, HermesError, InvalidArgs, OutputTooLarge, ToolTimeout

from . import ACCEPT_ENCODING, Inflater

DEFAULT_HANDSHAKE_TIMEOUT = 10.0
_INVALID_PARAMS = -32602
CONNECTION_CLOSED = -32000
# Errors that mean the connection itself is gone (not that the server answered with an error).
TRANSPORT_ERRORS = (
    anyio.ClosedResourceError,
    anyio.BrokenResourceError,
    anyio.EndOfStream,
    ConnectionError,
    EOFError,
)
MCP_EXTRA = "pip install 'hermes-gateway[mcp]'"
MCP_TIMEOUT = 30.0
MCP_READ_TIMEOUT = 300.0


def message_limit(max_output: int) -> int:
    """The bytes one message from an MCP server may take: a result comes as text and again as structured
    content, in an envelope (the result itself is held to ``max_output`` once read)."""
    return 2 * max_output + 64 * 1024


def over_limit(e: BaseException) -> bool:
    """True for the SDK's answer to a message past the limit (an SSE event's, or a JSON body's)."""
    return "byte limit" in str(getattr(e, "message", ""))


def require_sdk(what: str = "the mcp executor") -> None:
    """ExecutorError unless the ``mcp`` SDK 2.x (the ``mcp`` extra) is importable; ``hermes-agent[mcp]``
    pins mcp 1.x."""
    try:
        from mcp import Client  # noqa: F401 - the 2.x client API
    except ImportError:
        try:
            from importlib.metadata import version

            found = f"mcp {version('mcp')} is installed, not 2.x"
        except Exception:  # noqa: BLE001 - not installed at all
            found = "it is not installed"
        missing = ExecutorError(f"{what} needs the MCP SDK 2.x ({found}): {MCP_EXTRA}", error_type="mcp_sdk_missing")
        missing.retryable = False  # (as the instance says: another try finds no SDK either)
        raise missing from None


def client_for(server: dict[str, Any], limit: int, overflowed: Callable[[], None]) -> Any:
    """An unentered ``mcp.Client`` for the server; a message from it may take ``limit`` bytes (a stdio line
    past that calls ``overflowed`` and ends the connection)."""
    require_sdk()
    from mcp import Client

    if server.get("url"):
        import httpx2  # the SDK's HTTP client library
        from mcp.client.streamable_http import streamable_http_client

        class Capped(httpx2.AsyncByteStream):
            """A body inflated piece by piece (``Inflater``), a JSON one read only up to the limit (an SSE one is
            bounded by event, by the SDK)."""

            def __init__(self, stream: Any, coding: str, most: float) -> None:
                self.stream, self.coding, self.most = stream, coding, most

            async def __aiter__(self) -> AsyncIterator[bytes]:
                read = 0
                try:
                    inflater = Inflater(self.coding, limit + 1, f"MCP server {server['url']}")
                    async for raw in self._raw():
                        for chunk in inflater.pieces(raw):
                            if (read := read + len(chunk)) > self.most:  # (the SDK answers the call with this)
                                raise httpx2.StreamError(f"the response exceeded the {limit} byte limit")
                            yield chunk
                except ExecutorError as e:
                    raise httpx2.StreamError(str(e)) from None

            async def _raw(self) -> AsyncIterator[bytes]:
                async for raw in self.stream:
                    yield raw
                yield b""  # the end: what the inflater still holds

            async def aclose(self) -> None:
                await self.stream.aclose()

        async def cap(response: Any) -> None:  # (the body comes out inflated: httpx2 must not inflate it again)
            sse = response.headers.get("content-type", "").startswith("text/event-stream")
            response.stream = Capped(response.stream, response.headers.pop("content-encoding", ""), inf if sse else limit)

        headers = {str(k): str(v) for k, v in (server.get("headers") or {}).items()}
        http = httpx2.AsyncClient(
            headers={"Accept-Encoding": ACCEPT_ENCODING, **headers},
            timeout=httpx2.Timeout(MCP_TIMEOUT, read=MCP_READ_TIMEOUT),
            event_hooks={"response": [cap]},
        )
        transport = streamable_http_client(str(server["url"]), http_client=http, max_sse_event_size=limit)
        return Client(transport, cache=None)
    return Client(_stdio(server, limit, overflowed), cache=None)


@contextlib.asynccontextmanager
async def _stdio(server: dict[str, Any], limit: int, overflowed: Callable[[], None]) -> AsyncIterator[Any]:
    """The SDK's stdio transport, but reading at most ``limit`` bytes of a line: a larger one (a huge result,
    or bytes that never end in a newline) ends the connection instead of growing the worker without bound."""
    from mcp.client.stdio import _stop_server_process, get_default_environment
    from mcp.shared.message import SessionMessage
    from mcp.types import jsonrpc_message_adapter

    command = server["command"]
    argv = [str(a) for a in (command if isinstance(command, list) else [command, *server.get("args", [])])]
    env = {str(k): str(v) for k, v in (server.get("env") or {}).items()}
    stderr = subprocess.DEVNULL if server.get("stderr") == "discard" else None
    process = await anyio.open_process(
        argv, env=get_default_environment() | env, cwd=server.get("cwd"), stderr=stderr, start_new_session=True
    )
    to_session, from_server = anyio.create_memory_object_stream[Any](0)
    to_server, from_session = anyio.create_memory_object_stream[Any](0)

    async def read() -> None:
        assert process.stdout
        pending = bytearray()
        async with to_session:
            async for chunk in process.stdout:
                *lines, rest = chunk.split(b"\n")
                if lines:
                    lines[0], pending = bytes(pending) + lines[0], bytearray()
                pending += rest
                for line in lines:
                    # (decoded with replacement: one line that is not UTF-8 once killed the SDK's reader)
                    with contextlib.suppress(ValueError):  # not JSON-RPC (a stray print): dropped
                        message = jsonrpc_message_adapter.validate_json(line.decode(errors="replace"), by_name=False)
                        await to_session.send(SessionMessage(message))
                if len(pending) > limit:
                    return overflowed()

    async def write() -> None:
        assert process.stdin
        async with from_session:
            async for item in from_session:
                data = item.message.model_dump_json(by_alias=True, exclude_unset=True)
                await process.stdin.send(data.encode() + b"\n")

    async def guarded(part: Callable[[], Awaitable[None]]) -> None:
        # A closed pipe or session ends the connection: the session sees its read stream end.
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await part()
        await to_session.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(guarded, read)
        tg.start_soon(guarded, write)
        try:
            yield from_server, to_server
        finally:
            with anyio.CancelScope(shield=True):  # stdin closed, then the process group ended (bounded waits)
                await _stop_server_process(process)
            tg.cancel_scope.cancel()


class Session:
    """One live client, held open by its own task on the executor's loop."""

    def __init__(self, server: dict[str, Any], handshake_timeout: float, limit: int) -> None:
        self.server = server
        self.handshake_timeout = handshake_timeout
        self.limit = limit
        self.overflowed = False  # the stdio server sent a line past the limit: the session is over
        self.client: Any = None
        self.task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    @property
    def alive(self) -> bool:
        if self.client is None or self.task is None or self.task.done():
            return False
        # The SDK marks its dispatcher closed when the server's stream ends; there is no public flag
        # (test_mcp_internals.py checks these names on the pinned mcp version).
        dispatcher = getattr(getattr(self.client, "_session", None), "_dispatcher", None)
        return not getattr(dispatcher, "_closed", False)

    async def start(self) -> None:
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self._hold(ready))
        try:
            # Timed from outside: a cancel scope around __aenter__ would close before the SDK's task groups.
            await asyncio.wait_for(asyncio.shield(ready), self.handshake_timeout)
        except TimeoutError:
            ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # consumed: no warning
            self.task.cancel()
            target = self.server.get("url") or self.server.get("command")
            raise ExecutorError(
                f"MCP server {target} did not finish the handshake within {self.handshake_timeout:g}s "
                "(raise mcp.handshake_timeout for slow servers)"
            ) from None

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        # The SDK's task groups must be entered and left by the same task: this one.
        client = client_for(self.server, self.limit, lambda: setattr(self, "overflowed", True))
        try:
            await client.__aenter__()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the session
            if not ready.done():
                ready.set_exception(e)
            return
        self.client = client
        ready.set_result(None)
        try:
            await self._stop.wait()
        finally:
            self.client = None
            try:
                with anyio.move_on_after(5, shield=True):
                    await client.__aexit__(None, None, None)
            except BaseException:  # noqa: BLE001 - the server may already be gone
                pass

    async def close(self) -> None:
        self._stop.set()
        if self.task is not None:
            with contextlib.suppress(BaseException):  # closing is best effort
                await asyncio.wait_for(asyncio.shield(self.task), 6)


class SessionPool:
    """One session per server, on the pool's own event loop; a dead session is re-established."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-executor-loop", daemon=True)
        self._thread.start()
        self._sessions: dict[str, Session] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def get(self, key: str, server: dict[str, Any], handshake_timeout: float, limit: int) -> Session:
        session = self._sessions.get(key)
        if session is not None and session.alive:  # (the usual case: no lock made or taken)
            return session
        async with self._locks.setdefault(key, asyncio.Lock()):
            session = self._sessions.get(key)
            if session is not None and session.alive:
                return session
            if session is not None:
                await session.close()
            session = Session(server, handshake_timeout, limit)
            await session.start()
            self._sessions[key] = session
            return session

    async def drop(self, key: str, session: Session) -> None:
        if self._sessions.get(key) is session:
            del self._sessions[key]
        await session.close()

    def close(self) -> None:
        async def close_all() -> None:
            for session in list(self._sessions.values()):
                await session.close()
            self._sessions.clear()

        if self._loop.is_running():
            with contextlib.suppress(Exception):  # shutdown is best effort
                self.submit(close_all()).result(timeout=15)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


def translate(e: BaseException, where: str, handshake: float, server: dict[str, Any]) -> HermesError:
    from mcp import MCPError

    target = server.get("url") or server.get("command")
    if isinstance(e, BaseExceptionGroup):  # the SDK's task groups: the first real failure says what happened
        if leaves := _leaves(e):
            return translate(leaves[0], where, handshake, server)
    if over_limit(e):
        return OutputTooLarge(f"{where}: MCP server {target} sent a message too large: {e}")
    if isinstance(e, TRANSPORT_ERRORS) or (isinstance(e, MCPError) and e.code == CONNECTION_CLOSED):
        hint = " (it exited? a stdio server's own error output is above)" if server.get("command") else ""
        return ExecutorError(f"{where}: MCP server {target} closed the connection{hint}")
    if isinstance(e, TimeoutError):
        return ExecutorError(
            f"{where}: MCP server {target} did not finish the handshake within {handshake:g}s "
            "(raise mcp.handshake_timeout for slow servers)"
        )
    if isinstance(e, MCPError):
        if e.code == _INVALID_PARAMS:
            return InvalidArgs(f"{where}: MCP server rejected the arguments: {e.message}", code=e.code)
        if "timed out" in e.message.lower():
            return ToolTimeout(f"{where}: MCP server did not answer in time: {e.message}")
        return ExecutorError(f"{where}: MCP error {e.code}: {e.message}", code=e.code)
    from pydantic import ValidationError

    if isinstance(e, ValidationError):  # (a ValueError too: not a server that failed to start)
        return ExecutorError(f"{where}: MCP server {target} sent a malformed result: {e}")
    if isinstance(e, OSError | ValueError):  # (transport errors were handled above)
        return ExecutorError(f"{where}: cannot start MCP server {target}: {e}")
    return ExecutorError(f"{where}: MCP server {target} failed: {type(e).__name__}: {e}")


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    """The exceptions inside nested groups, cancellations (the group's own clean-up) left out."""
    out: list[BaseException] = []
    for inner in group.exceptions:
        if isinstance(inner, BaseExceptionGroup):
            out.extend(_leaves(inner))
        elif not isinstance(inner, asyncio.CancelledError):
            out.append(inner)
    return out
