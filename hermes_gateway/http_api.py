"""The HTTP/SSE API, the web console and ``/mcp`` of ``hermes-gateway serve``: the Python client's
operations for callers in any language (routes: ``create_app``; reference: docs/http-and-mcp.md).
Admission errors are HTTP errors with a typed body (``http_guard``); a call that ran and failed is a
200 with ``"state": "failed"``. The endpoints are the methods of :class:`Api`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, nullcontext
from dataclasses import asdict
from importlib import resources
from typing import Any
from urllib.parse import quote

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Route

from broker import keys
from broker.audit import AuditLog
from broker.codec import text
from broker.connection import async_from_url
from broker.envelope import CONTEXT_FIELDS
from broker.errors import (
    CallCancelled,
    CallFailed,
    CallTimeout,
    HermesError,
    IdempotencyConflict,
    PermissionDenied,
    UnknownTool,
)
from broker.logs import redact
from broker.placeholders import sole
from hermes_gateway.aio import AsyncGateway
from hermes_gateway.aio_handle import AsyncCallHandle
from hermes_gateway.client import Gateway
from hermes_gateway.credentials import Caller, Credentials
from hermes_gateway.http_guard import ERROR_HANDLERS, guarded, request_caller
from hermes_gateway.http_json import JSONL_TYPES, BadRequest, dumps, parse_json, read_body, read_raw, reply
from hermes_gateway.views import call_request, status_data

TOKEN_ENV = "HERMES_API_TOKEN"
MAX_WAIT = 300.0  # seconds a request may hold on for a call's outcome


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds)):
        raise BadRequest(f"{name}: expected {what}, got {type(value).__name__}")
    return value


def _number(body: dict[str, Any], name: str, low: float, *, integer: bool = False) -> Any:
    """A finite number of at least ``low`` (None when absent)."""
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    value = _field(body, name, kinds, "an integer" if integer else "a number of seconds")
    if value is not None and (not math.isfinite(value) or value < low or abs(value) > 2**53):
        raise BadRequest(f"{name}: expected a finite number of at least {low:g}, got {value!r}")
    return value


# Context fields an HTTP caller may not set: replay_of is the replay route's; plugins_applied makes the
# workers skip those plugins' middleware and hooks for the call (the Hermes plugin's, over Redis, for the
# plugins its agent ran itself), so over HTTP it would switch off an operator's guardrails.
NOT_OVER_HTTP = ("replay_of", "plugins_applied")


def _context(body: dict[str, Any]) -> dict[str, Any]:
    context = _field(body, "context", (dict,), "an object") or {}
    if "plugins_applied" in context:
        raise BadRequest(
            "context: plugins_applied is not accepted over HTTP (it would make the workers skip those plugins' "
            "middleware and hooks, guardrails included)", fields=["plugins_applied"],
        )
    known = [k for k in CONTEXT_FIELDS if k not in NOT_OVER_HTTP]
    unknown = sorted(str(k) for k in context if k not in known)
    if unknown:
        raise BadRequest(f"context: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}", fields=unknown)
    return context


class Api:
    """The endpoints over ``gw``'s broker: ``gw`` (threads) for the directory and status, ``agw`` (an
    ``AsyncGateway`` on the same broker, opened by ``lifespan``) for calls, waits and event streams."""

    agw: AsyncGateway

    def __init__(self, gw: Gateway, mcp_stateful: bool) -> None:
        from workers.executors.mcp_session import require_sdk

        self.gw = gw
        try:  # the MCP SDK 2.x is the `mcp` extra: without it /mcp says what to install, the rest runs
            require_sdk("MCP over HTTP at /mcp")
            from hermes_gateway.mcp_http import McpEndpoint

            self.mcp: Any = McpEndpoint(gw, lambda: self.agw, stateful=mcp_stateful)
        except HermesError as e:  # (a Response is an ASGI app: every request is told what to install)
            self.mcp = reply({"error": e.to_wire()}, 501)

    @asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self.agw = AsyncGateway(await async_from_url(self.gw.broker.url), self.gw.settings, url=self.gw.broker.url)
        await self.agw.start()
        try:
            async with self.mcp.running() if hasattr(self.mcp, "running") else nullcontext():
                yield
        finally:
            await self.agw.close()

    async def healthz(self, _request: Request) -> Response:
        # No token wanted (probes), but the same origin and Host checks; the broker URL without passwords.
        return reply({"ok": True, "broker": self.gw.description})

    async def console(self, _request: Request) -> Response:
        page = resources.files("hermes_gateway").joinpath("console.html").read_text(encoding="utf-8")
        return HTMLResponse(page)

    async def status(self, request: Request) -> Response:
        caller = request_caller(request)
        return reply(await run_in_threadpool(status_data, self.gw, True, None if caller.admin else caller))

    async def list_tools(self, _request: Request) -> Response:
        def row(spec: Any, version: int) -> dict[str, Any]:
            return {
                "name": spec.name,
                "description": spec.description,
                "executor": spec.executor,
                "permissions": list(spec.permissions) if spec.permissions is not None else None,
                "concurrency": spec.concurrency,  # None: the default, which the next field gives
                "concurrency_effective": spec.concurrency or self.gw.settings.concurrency_for(spec.executor),
                "queue_size": spec.queue_size,
                "version": version,
            }

        return reply([row(entry.spec, entry.version) for entry in await self.agw.tools()])

    async def get_tool(self, request: Request) -> Response:
        entry = await self.agw.tool(request.path_params["name"])
        # Literal headers, environments and DSNs may hold credentials: masked as in the audit log; to a
        # token that may not manage tools, every literal header and env_set value (a name like DB_PASS or
        # CREDS is no secret to the masking's patterns): what the tool is called with stays readable.
        shown = redact(entry.spec.to_dict())
        try:
            await self._may_manage_tools(request)
        except PermissionDenied:
            for field in ("headers", "env_set", "metadata"):
                if isinstance(shown.get(field), dict):
                    shown[field] = {k: v if sole(str(v)) is not None else "***" for k, v in shown[field].items()}
        return reply({**shown, "version": entry.version})

    async def _may_manage_tools(self, request: Request) -> None:
        request_caller(request).check_manage_tools(await run_in_threadpool(self.gw.policy))

    async def register_tool(self, request: Request) -> Response:
        await self._may_manage_tools(request)
        body = await read_body(request, self.gw.settings.api)
        from workers.specs import check_spec, spec_from_yaml_text  # (registration's checks: the executors')

        if set(body) == {"yaml"}:  # the spec as YAML text (what the console sends when it is not JSON)
            if not isinstance(body["yaml"], str):
                raise BadRequest(f"yaml: expected the spec as YAML text, got {type(body['yaml']).__name__}")
            spec = await run_in_threadpool(spec_from_yaml_text, body["yaml"])
        else:
            spec = check_spec(body)
        version, outcome = await run_in_threadpool(self.gw.directory.put, spec)
        self.agw.invalidate(spec.name)
        return reply({"name": spec.name, "version": version, "outcome": outcome}, 201 if outcome == "added" else 200)

    async def remove_tool(self, request: Request) -> Response:
        name = request.path_params["name"]
        await self._may_manage_tools(request)
        removed = await run_in_threadpool(self.gw.directory.remove, name)
        self.agw.invalidate(name)
        if not removed:
            raise UnknownTool(f"unknown tool {name!r}: it is not in the tool directory", tool=name)
        return reply({"removed": name})

    async def schemas(self, request: Request) -> Response:
        principal = request_caller(request).principal_for(request.query_params.get("principal") or None)
        return reply(await run_in_threadpool(self.gw.tool_schemas, principal))

    async def call_tool(self, request: Request) -> Response:
        body = await read_body(request, self.gw.settings.api)
        args = _field(body, "args", (dict,), "an object")
        name = request.path_params["name"]

        async def ceiling() -> float:  # (the async client's cached lookup, which its call_tool then reuses)
            return float((await self.agw.tool(name)).spec.timeout)

        return await self._call(request, body, lambda **kw: self.agw.call_tool(name, args, **kw), ceiling)

    async def call_llm(self, request: Request) -> Response:
        """``POST /v1/llm/calls``: ``{"request": chat-completions kwargs, ...}`` as ``AsyncGateway.call_llm``."""
        body = await read_body(request, self.gw.settings.api)
        llm_request = _field(body, "request", (dict,), "an object (chat-completions kwargs: messages, model...)")
        if llm_request is None:
            raise BadRequest("request: expected an object (chat-completions kwargs: messages, model...)")
        async def ceiling() -> float:
            return float(self.gw.settings.model.timeout)

        return await self._call(request, body, lambda **kw: self.agw.call_llm(llm_request, **kw), ceiling)

    async def _call(
        self, request: Request, body: dict[str, Any], submit: Any, ceiling: Callable[[], Awaitable[float]]
    ) -> Response:
        """A call's submission with the body's context and options: 202 and where to follow it, or (``wait``)
        its outcome when it ends within that many seconds. A ``timeout`` past ``ceiling()`` (the tool's or
        the model's own) is an admin's to give: another token would hold slots past what the operator set."""
        context = _context(body)
        caller = request_caller(request)
        principal = caller.principal_for(context.pop("principal", None))
        if principal is not None:
            context["principal"] = principal
        wait = _number(body, "wait", 0)
        timeout = _number(body, "timeout", 0.001)
        if timeout is not None and not caller.admin:
            most = await ceiling()
            if float(timeout) > most:
                raise BadRequest(
                    f"timeout: at most {most:g} s for this token (the operator's timeout of the tool or model); "
                    "a shorter one is yours to give, a longer one an admin token's"
                )
        key = _field(body, "idempotency_key", (str,), "a string")
        header = request.headers.get("idempotency-key")  # (the standard header: the body's field wins)
        if header is not None and key is not None and header != key:
            raise BadRequest("the Idempotency-Key header and the body's idempotency_key differ: give one")
        key = key if key is not None else header
        attempts = _number(body, "max_attempts", 1, integer=True)
        trace = {name: request.headers.get(name) for name in ("traceparent", "tracestate")}  # W3C: continued
        try:
            handle = await submit(timeout=timeout, idempotency_key=key, max_attempts=attempts, **trace, **context)
        except IdempotencyConflict as e:
            raise _conflict_for(caller, e, key) from None
        if not wait:
            return reply(_accepted(handle), 202)
        outcome = await _outcome(handle, min(float(wait), MAX_WAIT))
        return reply(outcome, 200 if handle.done() else 202)

    async def _visible(self, request: Request, call_id: str) -> None:
        """Unknown call (404, the body of an id that does not exist) unless the caller may see it: a
        token that is not admin sees its own principal's calls only, so ids cannot be probed. One HGET."""
        caller = request_caller(request)
        if caller.admin:
            return
        owner = await self.agw.conn.hget(keys.job(call_id), keys.F_PRINCIPAL)
        if not caller.sees(text(owner) if owner is not None else None):
            raise CallFailed(f"no such call {call_id}", error_type="unknown_call")

    async def _handle(self, request: Request) -> AsyncCallHandle:
        """The path's call, if this caller may see it (404 for an unknown id)."""
        await self._visible(request, request.path_params["call_id"])
        return await self.agw.handle(request.path_params["call_id"])

    async def get_call(self, request: Request) -> Response:
        handle = await self._handle(request)
        return reply(await _outcome(handle, 0.0) if handle.done() else _accepted(handle))

    async def get_call_request(self, request: Request) -> Response:
        call_id = request.path_params["call_id"]
        await self._visible(request, call_id)
        audit = AuditLog.from_settings(self.gw.conn, self.gw.settings.audit)
        found = await run_in_threadpool(call_request, self.gw.conn, call_id, audit)
        if found is None:
            raise CallFailed(f"no such call {call_id}", error_type="unknown_call")
        return reply(found)

    async def cancel_call(self, request: Request) -> Response:
        call_id = (await self._handle(request)).call_id
        return reply({"call_id": call_id, "cancelled": await self.agw.cancel(call_id)})

    async def submit_batch(self, request: Request) -> Response:
        from hermes_gateway.batches import BatchJob

        raw = await read_raw(request, self.gw.settings.api, ("application/json", *JSONL_TYPES))
        tool, window = request.query_params.get("tool"), request.query_params.get("window")
        resume = request.query_params.get("resume")
        if request.headers.get("content-type", "").split(";")[0].strip().lower() in JSONL_TYPES:
            items: Any = _jsonl(raw)
        else:
            body = parse_json(raw)
            if isinstance(body, dict):
                tool = _field(body, "tool", (str,), "a tool name") or tool
                window = _number(body, "window", 1, integer=True) or window
                resume = _field(body, "resume", (str,), "a batch id") or resume
                items = _field(body, "items", (list,), "an array of argument objects")
                if items is None:
                    raise BadRequest("items: expected an array of argument objects")
            elif isinstance(body, list):
                items = body
            else:
                raise BadRequest(f"the body must be a JSON array of argument objects, got {type(body).__name__}")
        if resume is not None:  # the same items again after the submitter died: the batch's own tool
            await self._batch(request, resume)  # (unknown, or another principal's: 404)
            tool = tool or (await run_in_threadpool(BatchJob(self.gw, resume).progress)).tool
        if not tool:
            raise BadRequest("name the tool: POST /v1/batches?tool=NAME (or \"tool\" in a JSON object body)")
        try:
            size = int(window) if window is not None else None
        except ValueError as e:
            raise BadRequest(f"window: expected a whole number, got {window!r}") from e
        if size is not None and size < 1:
            raise BadRequest(f"window: expected a whole number of at least 1, got {size}")
        principal = request_caller(request).principal
        context: dict[str, Any] = {"principal": principal} if principal else {}
        job = await run_in_threadpool(lambda: self.gw.batch(tool, items, window=size, resume=resume, **context))
        base = "/v1/batches/" + job.id
        return reply({"id": job.id, "tool": tool, "items": len(items), "status": base, "results": base + "/results"}, 202)

    async def _batch(self, request: Request, batch_id: str | None = None) -> Any:
        """The batch (by default the path's), if this caller may see it (another principal's is unknown)."""
        from broker.errors import UnknownBatch
        from hermes_gateway.batches import BatchJob, BatchStore

        if batch_id is None:
            batch_id = request.path_params["batch_id"]
        meta = await run_in_threadpool(BatchStore(self.gw.conn).meta, batch_id)
        caller = request_caller(request)
        if not caller.admin and meta.get("principal", "") != (caller.principal or ""):
            raise UnknownBatch(f"no such batch {batch_id!r} (never made, or past its batch.ttl)", batch_id=batch_id)
        return BatchJob(self.gw, batch_id)

    async def list_batches(self, request: Request) -> Response:
        from hermes_gateway.batches import BatchStore

        caller = request_caller(request)
        store = BatchStore(self.gw.conn)
        rows = await run_in_threadpool(store.recent, 100, None if caller.admin else caller.principal or "")
        return reply([p.to_dict() for p in rows])

    async def get_batch(self, request: Request) -> Response:
        job = await self._batch(request)
        return reply((await run_in_threadpool(job.progress)).to_dict())

    async def batch_results(self, request: Request) -> Response:
        from hermes_gateway.batches import AsyncBatchJob

        job = AsyncBatchJob(await self._batch(request))
        follow = request.query_params.get("follow", "1") not in ("0", "false", "no")

        async def lines() -> AsyncIterator[str]:
            # (asynchronous, each read a short one in a thread: a follower waiting on a batch that makes no
            # progress holds no thread of the server's pool, and goes when its client does)
            async for item in job.results(follow=follow):
                yield dumps(item.to_dict()) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def cancel_batch(self, request: Request) -> Response:
        job = await self._batch(request)
        return reply({"id": job.id, "cancelled": await run_in_threadpool(job.cancel)})

    async def call_events(self, request: Request) -> Response:
        handle = await self._handle(request)
        raw = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
        try:
            after = int(raw)
        except ValueError as e:
            raise BadRequest(f"Last-Event-ID / after: expected an event seq, got {raw!r}") from e

        if handle.done() and after >= handle.last_seq:
            return Response(status_code=204)  # nothing more will come: an EventSource stops reconnecting

        async def stream() -> AsyncIterator[dict[str, str]]:
            async for event in handle.events():
                if event.seq > after:
                    data = dumps(asdict(event))
                    yield {"id": str(event.seq), "event": event.type, "data": data}

        return EventSourceResponse(stream(), ping=15)


def create_app(
    gw: Gateway, *, token: str | None = None, credentials: Credentials | None = None, mcp_stateful: bool = False
) -> Starlette:
    """The app over ``gw``'s broker; ``credentials`` default to ``token`` and ``api.tokens``."""
    from hermes_gateway.console_api import console_routes

    creds = credentials or Credentials.from_settings(gw.settings, token)
    api = Api(gw, mcp_stateful)
    origin = guarded(creds, token=False)  # the console page and probes: no token, the same origin checks
    auth = guarded(creds)
    events = guarded(creds, query_token=True)
    routes = [
        Route("/", api.console, middleware=origin),
        Route("/healthz", api.healthz, middleware=origin),
        Route("/v1/status", api.status, middleware=auth),
        Route("/v1/tools", api.list_tools, methods=["GET"], middleware=auth),
        Route("/v1/tools", api.register_tool, methods=["POST"], middleware=auth),
        Route("/v1/tools/{name}", api.get_tool, methods=["GET"], middleware=auth),
        Route("/v1/tools/{name}", api.remove_tool, methods=["DELETE"], middleware=auth),
        Route("/v1/tools/{name}/calls", api.call_tool, methods=["POST"], middleware=auth),
        Route("/v1/llm/calls", api.call_llm, methods=["POST"], middleware=auth),
        Route("/v1/schemas", api.schemas, middleware=auth),
        Route("/v1/calls/{call_id}", api.get_call, middleware=auth),
        Route("/v1/calls/{call_id}/request", api.get_call_request, middleware=auth),
        Route("/v1/calls/{call_id}/cancel", api.cancel_call, methods=["POST"], middleware=auth),
        Route("/v1/calls/{call_id}/events", api.call_events, middleware=events),
        Route("/v1/batches", api.submit_batch, methods=["POST"], middleware=auth),
        Route("/v1/batches", api.list_batches, methods=["GET"], middleware=auth),
        Route("/v1/batches/{batch_id}", api.get_batch, methods=["GET"], middleware=auth),
        Route("/v1/batches/{batch_id}", api.cancel_batch, methods=["DELETE"], middleware=auth),
        Route("/v1/batches/{batch_id}/results", api.batch_results, methods=["GET"], middleware=auth),
        Route("/mcp", api.mcp, middleware=auth),
        *console_routes(gw, creds, lambda: api.agw),  # the console's overview, workers, audit; /metrics
    ]
    return Starlette(routes=routes, exception_handlers=ERROR_HANDLERS, lifespan=api.lifespan)


def _conflict_for(caller: Caller, error: IdempotencyConflict, key: str | None) -> IdempotencyConflict:
    """The conflict as ``caller`` may see it: which call holds the key (maybe another's) only to an admin."""
    if caller.admin:
        return error
    return IdempotencyConflict(
        f"idempotency key {key!r} already belongs to another call (other arguments or another tool): reuse a "
        "key only to resubmit the same call",
        key=key,
    )


def _jsonl(raw: bytes) -> list[Any]:
    """A JSONL body's items, one per non-blank line (a line that is not JSON stays text: a failed item)."""
    items: list[Any] = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if line.strip():
            try:
                items.append(parse_json(line.encode(), "a line"))
            except BadRequest:
                items.append(line)
    return items


def _accepted(handle: AsyncCallHandle) -> dict[str, Any]:
    base = "/v1/calls/" + quote(handle.call_id, safe="")  # `{tools}.<hex>`: braces are not URL characters
    return {"call_id": handle.call_id, "name": handle.name, "state": handle.state, "events": f"{base}/events"}


async def _outcome(handle: AsyncCallHandle, wait: float) -> dict[str, Any]:
    """The call's result or error when it has ended within ``wait`` seconds, else where it stands."""
    out: dict[str, Any] = {"call_id": handle.call_id, "name": handle.name}
    try:
        out["result"] = await handle.result(timeout=wait)
        out["state"] = "done"
    except CallTimeout:
        return _accepted(handle)
    except CallCancelled as e:
        out.update(state="cancelled", error=e.to_wire())
    except HermesError as e:
        out.update(state=handle.final_state or "failed", error=e.to_wire())
    return out
