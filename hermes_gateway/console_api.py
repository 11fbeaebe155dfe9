"""The console's own routes, mounted by ``http_api.create_app``: its settings, a stream of overview
snapshots (``console_data.snapshot``), stopping a worker, the audit log (list, record, replay) and
``/metrics`` (``serve_metrics``). The routes are listed at the end of ``console_routes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import click
import structlog
from redis.exceptions import RedisError
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from broker import keys
from broker.audit import AuditLog
from broker.codec import text
from broker.connection import async_from_url
from broker.errors import CallFailed, HermesError
from hermes_gateway import console_data, replay
from hermes_gateway.credentials import Caller, Credentials
from hermes_gateway.http_guard import Forbidden, guarded, request_caller
from hermes_gateway.http_json import BadRequest, dumps, read_body, reply
from hermes_gateway.views import hide_probes

log = structlog.get_logger("hermes.console")

STATS_INTERVAL = 1.5  # seconds between snapshots of the overview
AUDIT_LIMIT = 200  # records one audit query returns at most
REPLAY_TIMEOUT = 60.0
STATES = ("done", "failed", "cancelled")


class StatsHub:
    """One loop reading snapshots while any page listens; every stream gets each one (or the latest)."""

    def __init__(self, gw: Any, interval: float = STATS_INTERVAL) -> None:
        self.gw = gw
        self.interval = interval
        self.latest: dict[str, Any] | None = None
        self._subs: set[asyncio.Queue[dict[str, Any]]] = set()
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=2)
        self._subs.add(queue)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            if self.latest is not None:
                yield self.latest
            while True:
                yield await queue.get()
        finally:
            self._subs.discard(queue)

    async def _run(self) -> None:
        listener = asyncio.create_task(self._listen())
        try:
            while self._subs:
                try:
                    snap = await run_in_threadpool(console_data.snapshot, self.gw)
                except (RedisError, OSError) as e:
                    snap = {"error": {"type": "broker_unavailable", "message": f"the broker did not answer: {e}"}}
                except Exception as e:  # noqa: BLE001 - one bad tick (a damaged record) must not end every stream
                    log.exception("console snapshot failed")
                    snap = {"error": {"type": "internal_error", "message": f"{type(e).__name__}: {e}"}}
                self.latest = snap
                for queue in list(self._subs):
                    if queue.full():  # a slow reader gets the newest, not a backlog
                        queue.get_nowait()
                    queue.put_nowait(snap)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self.interval)
                self._changed.clear()
        finally:
            listener.cancel()
            self.latest = None

    async def _listen(self) -> None:
        """Breaker changes (their pub/sub channel) wake the loop at once."""
        channel = keys.channel(self.gw.conn, keys.BREAKER_CHANNEL)
        while True:
            try:
                conn = await async_from_url(self.gw.broker.url)
            except HermesError:  # the broker is away: try again in a second
                await asyncio.sleep(1.0)
                continue
            pubsub = conn.pubsub()
            try:
                await pubsub.subscribe(channel)
                async for msg in pubsub.listen():
                    if msg.get("type") == "message":
                        self._changed.set()
            except (RedisError, OSError):
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
                    await conn.aclose()


def console_routes(gw: Any, creds: Credentials, agw: Callable[[], Any]) -> list[BaseRoute]:
    """The console's routes, each behind ``http_guard.Guard`` (origin and Host; the token on ``/v1``);
    ``agw``: the app's ``AsyncGateway`` (made at start-up), for what waits on a call."""
    from hermes_gateway import __version__
    from hermes_gateway.serve_metrics import CONTENT_TYPE, GatewayMetrics

    hub = StatsHub(gw)
    prometheus = GatewayMetrics(gw)
    audit_log = AuditLog.from_settings(gw.conn, gw.settings.audit)
    auth = guarded(creds)

    async def console_config(_request: Request) -> Response:
        about = {"version": __version__, "broker": gw.description, "trace_url": gw.settings.console.trace_url}
        return reply({**about, "token": creds.required, "stats_interval": hub.interval})

    async def stats_stream(request: Request) -> Response:
        caller = request_caller(request)
        mine = caller.principal or ""

        async def events() -> AsyncIterator[dict[str, str]]:
            async for snap in hub.stream():
                if not caller.admin:  # a probe's call id, a batch and a usage row may be another principal's
                    snap = {**snap, "breakers": hide_probes(snap.get("breakers") or []),
                            "batches": await run_in_threadpool(console_data.batches, gw.conn, 20, mine),
                            "usage": [u for u in snap.get("usage") or [] if caller.sees(u.get("principal"))]}
                yield {"event": "stats", "data": dumps(snap)}

        return EventSourceResponse(events(), ping=15)

    async def stop_worker(request: Request) -> Response:
        name = request.path_params["name"]
        if not creds.required or not request_caller(request).admin:  # (else any local page could)
            raise Forbidden(
                "stopping a worker from the API needs an admin token (serve --token, $HERMES_API_TOKEN or an "
                f"admin entry of api.tokens); or run `hermes-gateway stop {name}`"
            )
        from workers.worker import control_message

        def send() -> int | str:
            if gw.conn.zscore(keys.WORKERS, name) is None:  # a typo must not read as done
                return ", ".join(sorted(text(n) for n in gw.conn.zrange(keys.WORKERS, 0, -1))) or "none"
            channel = keys.channel(gw.conn, keys.CONTROL_CHANNEL)
            return int(gw.conn.publish(channel, control_message("stop", worker=name)))

        listening = await run_in_threadpool(send)
        if isinstance(listening, str):
            error = {"type": "unknown_worker", "message": f"no worker {name!r} (known: {listening})"}
            return reply({"error": error}, 404)
        return reply({"worker": name, "stop_sent": True, "listening": listening})

    async def audit_list(request: Request) -> Response:
        q = request.query_params
        state = q.get("state") or None
        if state is not None and state not in STATES:
            raise BadRequest(f"state: expected one of {', '.join(STATES)}, got {state!r}")
        try:
            limit = min(int(q.get("limit") or 50), AUDIT_LIMIT)
        except ValueError as e:
            raise BadRequest(f"limit: expected a number, got {q.get('limit')!r}") from e
        caller, principal = request_caller(request), q.get("principal") or None
        if not caller.admin:  # its own principal's records only; another's: none, as for a name never used
            if principal not in (None, caller.principal):
                return reply([])
            principal = caller.principal
        records = await run_in_threadpool(
            audit_log.list,
            tool=q.get("tool") or None,
            principal=principal,
            state=state,
            since=_when(q.get("since"), "since"),
            until=_when(q.get("until"), "until"),
            session_id=q.get("session") or None,
            limit=max(1, limit),
        )
        return reply([r.to_dict() for r in records])

    def visible_record(call_id: str, caller: Caller) -> Any:
        rec = audit_log.get(call_id)
        if rec is None or not caller.sees(rec.principal):  # another's: as an unknown id
            raise CallFailed(f"no audit record for call {call_id}", error_type="unknown_call")
        return rec

    async def audit_get(request: Request) -> Response:
        from broker import events

        call_id = request.path_params["call_id"]
        rec = await run_in_threadpool(visible_record, call_id, request_caller(request))
        history = await run_in_threadpool(events.history, gw.conn, call_id)
        return reply({"record": rec.to_dict(), "events": [e.to_dict() for e in history]})

    async def audit_replay(request: Request) -> Response:
        call_id = request.path_params["call_id"]
        body = await read_body(request, gw.settings.api)
        supplied = body.get("args") or {}
        if not isinstance(supplied, dict) or not all(isinstance(v, str) for v in supplied.values()):
            raise BadRequest("args: expected an object of redacted argument name -> value as text")
        timeout = body.get("timeout", REPLAY_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 300:
            raise BadRequest(f"timeout: expected seconds in (0, 300], got {timeout!r}")
        caller = request_caller(request)

        def planned() -> Any:
            rec = visible_record(call_id, caller)
            plan = replay.plan(rec, supplied, audit_log.digest)  # what `audit replay` does, step by step
            # As the replaying token's principal (an admin token without one: as recorded), under the policy.
            context = {k: v for k, v in plan.context.items() if k != "principal"}
            who = caller.principal or (rec.principal if caller.admin else None)
            plan = dataclasses.replace(plan, context={**context, **({"principal": who} if who else {})})
            gw.require_workers(str(gw.tool(plan.tool).spec.config.get("queue") or "tools"))
            return plan

        plan = await run_in_threadpool(planned)
        # The wait is the event loop's, not a pool thread's: replays waiting on a busy tool must not hold
        # the threads every other route of every principal runs on.
        outcome = await replay.arun(agw(), audit_log, plan, float(timeout))
        return reply({
            "call_id": outcome.call_id,
            "state": outcome.state,
            "result": outcome.result,
            "error": outcome.error,
            "recorded": plan.record.to_dict(),
            "record": outcome.record.to_dict() if outcome.record is not None else None,
            "notes": outcome.notes,
            "comparison": replay.render(outcome),
        })

    async def metrics(_request: Request) -> Response:
        try:
            body = await run_in_threadpool(prometheus.render)
        except (RedisError, OSError) as e:
            return Response(f"# the broker did not answer: {e}\n", status_code=503, media_type="text/plain")
        return Response(body, media_type=CONTENT_TYPE)

    return [
        Route("/metrics", metrics, middleware=guarded(creds, token=False)),
        Route("/v1/console", console_config, middleware=auth),
        Route("/v1/stream/stats", stats_stream, middleware=guarded(creds, query_token=True)),
        Route("/v1/workers/{name}/stop", stop_worker, methods=["POST"], middleware=auth),
        Route("/v1/audit", audit_list, middleware=auth),
        Route("/v1/audit/{call_id}", audit_get, middleware=auth),
        Route("/v1/audit/{call_id}/replay", audit_replay, methods=["POST"], middleware=auth),
        Mount("/static", StaticFiles(packages=[("hermes_gateway", "static")]), name="static"),
    ]


def _when(value: str | None, name: str) -> float | None:
    """``since``/``until``: 15m, 2h, 7d ago, an ISO time or unix seconds (as ``audit list --since``)."""
    if not value:
        return None
    from hermes_gateway.cli.audit_cmd import parse_when

    try:
        return parse_when(value)
    except click.BadParameter as e:
        raise BadRequest(f"{name}: {e.message}") from e
