"""The ``mcp`` executor: call tools on MCP servers (stdio or streamable HTTP) through the ``mcp`` SDK.

Spec keys:

- ``mcp``: the server: ``{command: [prog, args...], env: {...}, cwd: ...}`` (stdio) or ``{url: ...,
  headers: {...}}`` (streamable HTTP), or ``{server: name}`` naming ``executors.mcp.servers.<name>``.
- ``tool``: the tool's name on the server (default: the spec's name).
- ``handshake_timeout``: seconds to connect and negotiate (default 10; also ``executors.mcp``).
- ``max_output``: cap on the result's JSON size in bytes (default 1 MiB).

The SDK is async: each executor runs one private event loop in a background thread, and worker threads
submit calls to it. One session per server is kept per process and re-established when the server dies.
A result with ``isError`` is a failed call carrying the server's message. ``traceparent``,
``tracestate`` and ``baggage`` (when the caller sent any) travel in the request's ``_meta``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any

import anyio

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

from .base import ExecContext

DEFAULT_HANDSHAKE_TIMEOUT = 10.0
DEFAULT_MAX_OUTPUT = 1024 * 1024
_INVALID_PARAMS = -32602
_CONNECTION_CLOSED = -32000
_POLL = 0.05
# Errors that mean the connection itself is gone (not that the server answered with an error).
_TRANSPORT_ERRORS = (
    anyio.ClosedResourceError,
    anyio.BrokenResourceError,
    anyio.EndOfStream,
    ConnectionError,
    EOFError,
)


def server_config(config: dict[str, Any], settings: dict[str, Any], where: str) -> dict[str, Any]:
    """The server a spec points at, resolved and checked."""
    server = config.get("mcp")
    if isinstance(server, str):
        server = {"server": server}
    if not isinstance(server, dict):
        raise InvalidSpec(f"{where}: mcp: expected {{command: [...]}} or {{url: ...}} or {{server: name}}")
    if "server" in server:
        named = (settings.get("servers") or {}).get(server["server"])
        if not isinstance(named, dict):
            raise InvalidSpec(f"{where}: mcp: no server named {server['server']!r} in executors.mcp.servers")
        server = named
    if not server.get("command") and not server.get("url"):
        raise InvalidSpec(f"{where}: mcp: a server needs a command (stdio) or a url (streamable HTTP)")
    return server


MCP_EXTRA = "pip install 'hermes-gateway[mcp]'"


def require_sdk(what: str = "the mcp executor") -> None:
    """ExecutorError unless the ``mcp`` SDK 2.x is importable. It is the ``mcp`` extra: the Hermes agent
    plugin installs beside ``hermes-agent[mcp]``, whose MCP client pins mcp 1.x."""
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


def _client(server: dict[str, Any]) -> Any:
    """An unentered ``mcp.Client`` for the server."""
    require_sdk()
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    if server.get("url"):
        headers = {str(k): str(v) for k, v in (server.get("headers") or {}).items()}
        http = create_mcp_http_client(headers=headers or None)
        return Client(streamable_http_client(str(server["url"]), http_client=http), cache=None)
    command = server["command"]
    argv = [str(a) for a in (command if isinstance(command, list) else [command, *server.get("args", [])])]
    params = StdioServerParameters(
        command=argv[0],
        args=argv[1:],
        env={str(k): str(v) for k, v in (server.get("env") or {}).items()} or None,
        cwd=server.get("cwd"),
    )
    errlog = open(os.devnull, "w") if server.get("stderr") == "discard" else None  # noqa: SIM115
    transport = stdio_client(params, errlog=errlog) if errlog else stdio_client(params)
    return Client(transport, cache=None)


class _Session:
    """One live client, held open by its own task on the executor's loop."""

    def __init__(self, server: dict[str, Any], handshake_timeout: float) -> None:
        self.server = server
        self.handshake_timeout = handshake_timeout
        self.client: Any = None
        self.task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    @property
    def alive(self) -> bool:
        if self.client is None or self.task is None or self.task.done():
            return False
        # The SDK marks its dispatcher closed when the server's stream ends (the process died or the
        # HTTP session went away); there is no public flag, so look and degrade gracefully.
        dispatcher = getattr(getattr(self.client, "_session", None), "_dispatcher", None)
        return not getattr(dispatcher, "_closed", False)

    async def start(self) -> None:
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self._hold(ready))
        try:
            # The handshake deadline is kept from outside: a cancel scope around __aenter__ would
            # close before the SDK's own task groups do, which anyio forbids.
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
        client = _client(self.server)
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
            try:
                await asyncio.wait_for(asyncio.shield(self.task), 6)
            except BaseException:  # noqa: BLE001 - closing is best effort
                pass


class McpExecutor:
    """Calls MCP tools; thread-safe (all session state lives on the executor's own loop)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-executor-loop", daemon=True)
        self._thread.start()
        self._sessions: dict[str, _Session] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _session(self, key: str, server: dict[str, Any], handshake_timeout: float) -> _Session:
        session = self._sessions.get(key)
        if session is not None and session.alive:
            return session
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            session = self._sessions.get(key)
            if session is not None and session.alive:
                return session
            if session is not None:
                await session.close()
            session = _Session(server, handshake_timeout)
            await session.start()
            self._sessions[key] = session
            return session

    async def _drop(self, key: str, session: _Session) -> None:
        if self._sessions.get(key) is session:
            del self._sessions[key]
        await session.close()

    async def _call(
        self,
        key: str,
        server: dict[str, Any],
        handshake: float,
        name: str,
        args: dict[str, Any],
        ctx: ExecContext,
    ) -> Any:
        meta: dict[str, Any] = dict(ctx.trace_headers())

        async def progress(value: float, total: float | None, message: str | None) -> None:
            try:
                ctx.progress(message or (f"{value:g}/{total:g}" if total else f"{value:g}"))
            except Exception:  # noqa: BLE001 - a progress sink failure must not fail the call
                pass

        # Session start is shared by concurrent callers: one caller's cancellation must not abort it.
        session = await asyncio.shield(self._session(key, server, handshake))
        try:
            return await session.client.call_tool(
                name,
                args,
                read_timeout_seconds=max(0.001, ctx.deadline - time.monotonic()),
                progress_callback=progress,
                meta=meta or None,
            )
        except Exception as e:
            # The connection died with this call in flight. No retry here: the tool may have run, and
            # retrying is the gateway's decision (ExecutorError is retryable). The next call reconnects.
            if isinstance(e, _TRANSPORT_ERRORS) or getattr(e, "code", None) == _CONNECTION_CLOSED:
                await self._drop(key, session)
            raise

    def run(self, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext) -> Any:
        config = {**self.settings, **spec.config}
        where = f"tool {spec.name!r}"
        server = server_config(config, self.settings, where)
        key = json.dumps(server, sort_keys=True, default=str)
        handshake = float(config.get("handshake_timeout", DEFAULT_HANDSHAKE_TIMEOUT))
        name = str(config.get("tool") or spec.name)
        max_output = int(config.get("max_output", DEFAULT_MAX_OUTPUT))
        ctx.check()
        future = self._submit(self._call(key, server, handshake, name, dict(args), ctx))
        # Poll with wait(), not result(timeout): the call's own TimeoutError must not read as "not yet".
        while not concurrent.futures.wait(
            [future], timeout=max(0.0, min(_POLL, ctx.deadline - time.monotonic()))
        )[0]:
            if ctx.cancelled.is_set():
                future.cancel()
                raise CallCancelled(f"call {ctx.call_id} was cancelled")
            if time.monotonic() >= ctx.deadline:
                future.cancel()
                raise ToolTimeout(f"{where}: timed out after {ctx.timeout:g}s", timeout=ctx.timeout)
        try:
            result = future.result()
        except HermesError:
            raise
        except concurrent.futures.CancelledError as e:
            raise CallCancelled(f"call {ctx.call_id} was cancelled") from e
        except Exception as e:  # noqa: BLE001 - every SDK/transport failure becomes a typed error
            raise _translate(e, where, handshake, server) from e
        # A spec imported before `unwrap_result` existed declares the wrapper itself: keep the wrapper then.
        declared = spec.output_schema
        keep = isinstance(declared, dict) and wrapped_result_schema(declared) is not None
        return _result(
            result, where, max_output, unwrap=bool(config.get("unwrap_result")) and not keep, keep=keep
        )

    def close(self) -> None:
        async def close_all() -> None:
            for session in list(self._sessions.values()):
                await session.close()
            self._sessions.clear()

        if self._loop.is_running():
            try:
                self._submit(close_all()).result(timeout=15)
            except Exception:  # noqa: BLE001 - shutdown is best effort
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


def _translate(e: BaseException, where: str, handshake: float, server: dict[str, Any]) -> HermesError:
    from mcp import MCPError

    target = server.get("url") or server.get("command")
    if isinstance(e, BaseExceptionGroup):  # the SDK's task groups: the first real failure says what happened
        leaves = _leaves(e)
        if leaves:
            return _translate(leaves[0], where, handshake, server)
    if isinstance(e, _TRANSPORT_ERRORS) or (isinstance(e, MCPError) and e.code == _CONNECTION_CLOSED):
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
        if e.code == _CONNECTION_CLOSED:
            return ExecutorError(
                f"{where}: MCP server {target} closed the connection: {e.message}", code=e.code
            )
        return ExecutorError(f"{where}: MCP error {e.code}: {e.message}", code=e.code)
    if isinstance(e, OSError | ValueError) and not isinstance(e, _TRANSPORT_ERRORS):
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


def _result(result: Any, where: str, max_output: int, unwrap: bool = False, keep: bool = False) -> Any:
    """A tool's result as plain data: structured content if any, else text, else content blocks.

    A non-object return value arrives wrapped as ``{"result": value}``: unwrapped when ``unwrap`` (the
    spec says the server wraps), else when its text shows it is a wrapper; never when ``keep``.
    """
    blocks = [b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in result.content]
    texts = [b.get("text", "") for b in blocks if b.get("type") == "text"]
    if result.is_error:
        message = "\n".join(texts) or "the tool reported an error"
        raise ExecutorError(f"{where}: {message}", remote_error=True)
    if result.structured_content is not None:
        value = result.structured_content
        wrapped = isinstance(value, dict) and set(value) == {"result"}
        if wrapped and not keep and (unwrap or _is_wrapped(value["result"], texts)):
            value = value["result"]  # how servers wrap a non-object return value
    elif blocks and len(texts) == len(blocks):
        value = texts[0] if len(texts) == 1 else "\n".join(texts)
    else:
        value = blocks
    size = len(json.dumps(value, ensure_ascii=False, default=str).encode())
    if size > max_output:
        raise OutputTooLarge(
            f"{where}: result of {size} bytes passes the cap of {max_output}", limit=max_output
        )
    return value


def wrapped_result_schema(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The schema of the value inside the ``{"result": ...}`` wrapper MCP SDK servers put around a
    non-object return value (an object with only a required ``result``, titled ``<tool>Output``), or
    None when ``schema`` is not that wrapper. Shared ``$defs`` stay with it, so its references resolve."""
    props = schema.get("properties")
    if (
        schema.get("type") != "object"
        or not isinstance(props, dict)
        or set(props) != {"result"}
        or schema.get("required") != ["result"]
        or not str(schema.get("title", "")).endswith("Output")
        or not isinstance(props["result"], dict)
    ):
        return None
    inner = dict(props["result"])
    if "$defs" in schema and "$defs" not in inner:
        inner["$defs"] = schema["$defs"]
    return inner


def _is_wrapped(inner: Any, texts: list[str]) -> bool:
    """True when ``{"result": inner}`` is only the SDK's wrapper around the text the tool returned."""
    if len(texts) != 1:
        return False
    return texts[0] in (
        inner if isinstance(inner, str) else None,
        json.dumps(inner),
        json.dumps(inner, indent=2),
    )


def list_server_tools(
    server_cfg: dict[str, Any], *, handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
) -> list[dict[str, Any]]:
    """The server's tools as tool-spec dicts (for ``hermes-gateway mcp add``)."""

    async def fetch() -> list[Any]:
        session = _Session(server_cfg, handshake_timeout)
        await session.start()
        try:
            tools: list[Any] = []
            cursor = None
            for _ in range(100):
                page = await session.client.list_tools(cursor=cursor)
                tools.extend(page.tools)
                cursor = page.next_cursor
                if not cursor:
                    break
            return tools
        finally:
            await session.close()

    try:
        tools = asyncio.run(fetch())
    except HermesError:
        raise
    except Exception as e:  # noqa: BLE001
        raise _translate(e, "mcp", handshake_timeout, server_cfg) from e
    specs = []
    for tool in tools:
        spec: dict[str, Any] = {
            "name": tool.name,
            "description": tool.description or "",
            "executor": "mcp",
            "mcp": server_cfg,
            "tool": tool.name,
            "input_schema": tool.input_schema or {"type": "object"},
        }
        if tool.output_schema:
            inner = wrapped_result_schema(tool.output_schema)
            if inner is None:
                spec["output_schema"] = tool.output_schema
            else:  # the result the gateway returns (and checks) is the value, not the server's wrapper
                spec["output_schema"], spec["unwrap_result"] = inner, True
        specs.append(spec)
    return specs


def create(settings: dict[str, Any]) -> McpExecutor:
    return McpExecutor(settings)
