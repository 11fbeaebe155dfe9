"""The ``mcp`` executor: call tools on MCP servers (stdio or streamable HTTP) through the ``mcp`` SDK.

One session per server per process (``mcp_session.py``), re-established when the server dies. A result
with ``isError`` is a failed call; the call's trace headers travel in the request's ``_meta``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any

from broker.errors import CallCancelled, ExecutorError, HermesError, InvalidSpec, OutputTooLarge
from broker.toolspec import ToolSpec

from . import DEFAULT_MAX_OUTPUT, ExecContext, require
from .mcp_session import (
    CONNECTION_CLOSED,
    DEFAULT_HANDSHAKE_TIMEOUT,
    TRANSPORT_ERRORS,
    Session,
    SessionPool,
    message_limit,
    over_limit,
    translate,
)


def server_config(config: dict[str, Any], settings: dict[str, Any], where: str) -> dict[str, Any]:
    """The server a spec points at, resolved and checked."""
    server = config.get("mcp")
    if isinstance(server, str):
        server = {"server": server}
    if not isinstance(server, dict):
        raise InvalidSpec.at(where, "mcp", "expected {command: [...]} or {url: ...} or {server: name}")
    if "server" in server:
        named = (settings.get("servers") or {}).get(server["server"])
        if not isinstance(named, dict):
            raise InvalidSpec.at(where, "mcp", f"no server named {server['server']!r} in executors.mcp.servers")
        server = named
    if not server.get("command") and not server.get("url"):
        raise InvalidSpec.at(where, "mcp", "a server needs a command (stdio) or a url (streamable HTTP)")
    return server


class McpExecutor:
    """Calls MCP tools; thread-safe (all session state lives on the pool's own loop)."""

    # mcp_server: the label ``mcp remove`` finds the tool by; unwrap_result: set by ``mcp add``.
    keys = frozenset({"mcp", "server", "tool", "handshake_timeout", "max_output", "mcp_server", "unwrap_result"})

    @staticmethod
    def check(where: str, data: Mapping[str, Any]) -> None:
        require(where, "mcp", data, ("mcp", "server"), "the server: {command: [...]} | {url: ...} | {server: name}")

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self._pool = SessionPool()

    async def _call(
        self, server: dict[str, Any], handshake: float, limit: int, name: str, args: dict[str, Any], ctx: ExecContext
    ) -> Any:
        key = json.dumps([server, limit], sort_keys=True, default=str)  # (a session reads messages up to its limit)

        async def progress(value: float, total: float | None, message: str | None) -> None:
            with contextlib.suppress(Exception):  # a progress sink failure must not fail the call
                ctx.progress(message or (f"{value:g}/{total:g}" if total else f"{value:g}"))

        # Session start is shared by concurrent callers: one caller's cancellation must not abort it.
        session = await asyncio.shield(self._pool.get(key, server, handshake, limit))
        try:
            return await session.client.call_tool(
                name,
                args,
                read_timeout_seconds=max(0.001, ctx.deadline - time.monotonic()),
                progress_callback=progress,
                meta=ctx.trace_headers() or None,
            )
        except Exception as e:
            # The connection died: no retry here (the tool may have run); the next call reconnects.
            closed = isinstance(e, TRANSPORT_ERRORS) or getattr(e, "code", None) == CONNECTION_CLOSED
            if closed and not over_limit(e):  # (an SSE event past the limit ends only its own call)
                await self._pool.drop(key, session)
            if session.overflowed:
                target = server.get("command")
                raise OutputTooLarge(
                    f"tool {ctx.tool_name!r}: MCP server {target} sent a line past the limit of {limit} bytes "
                    "(the server was stopped)",
                    limit=limit,
                ) from None
            raise

    def run(self, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext) -> Any:
        config = {**self.settings, **spec.config}
        where = f"tool {spec.name!r}"
        server = server_config(config, self.settings, where)
        handshake = float(config.get("handshake_timeout", DEFAULT_HANDSHAKE_TIMEOUT))
        name = str(config.get("tool") or spec.name)
        max_output = int(config.get("max_output", DEFAULT_MAX_OUTPUT))
        ctx.check()
        future = self._pool.submit(self._call(server, handshake, message_limit(max_output), name, dict(args), ctx))
        # Poll with wait(), not result(timeout): the call's own TimeoutError must not read as "not yet".
        while not concurrent.futures.wait([future], timeout=ctx.poll_slice())[0]:
            if ctx.cancelled.is_set() or time.monotonic() >= ctx.deadline:
                future.cancel()
                ctx.check_at(where)
        try:
            result = future.result()
        except HermesError:
            raise
        except concurrent.futures.CancelledError as e:
            raise CallCancelled(f"call {ctx.call_id} was cancelled") from e
        except Exception as e:  # noqa: BLE001 - every SDK/transport failure becomes a typed error
            raise translate(e, where, handshake, server) from e
        # A spec imported before `unwrap_result` existed declares the wrapper itself: keep the wrapper then.
        declared = spec.output_schema
        keep = isinstance(declared, dict) and wrapped_result_schema(declared) is not None
        return _result(result, where, max_output, unwrap=bool(config.get("unwrap_result")), keep=keep)

    def close(self) -> None:
        self._pool.close()


def _result(result: Any, where: str, max_output: int, unwrap: bool, keep: bool) -> Any:
    """A tool's result as plain data: structured content if any, else text, else content blocks.
    ``{"result": value}`` is unwrapped when ``unwrap`` or its text shows a wrapper; never when ``keep``."""
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
    """The schema inside the ``{"result": ...}`` wrapper SDK servers put around a non-object return value
    (an object with only a required ``result``, titled ``<tool>Output``; ``$defs`` kept), else None."""
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
        session = Session(server_cfg, handshake_timeout, message_limit(DEFAULT_MAX_OUTPUT))
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
        raise translate(e, "mcp", handshake_timeout, server_cfg) from e
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
            if (inner := wrapped_result_schema(tool.output_schema)) is None:
                spec["output_schema"] = tool.output_schema
            else:  # the result the gateway returns (and checks) is the value, not the server's wrapper
                spec["output_schema"], spec["unwrap_result"] = inner, True
        specs.append(spec)
    return specs

