"""The broker (and workers) of one command: ``HERMES_REDIS_URL``; else the embedded broker of a ``serve`` or
``worker`` of the same ``$HERMES_HOME`` here; else a broker and workers of its own, for the command."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis

from broker import keys, logs
from broker.codec import unpack
from broker.config import Settings
from broker.connection import URL_ENV, BrokerHandle, connect, from_url, subscriber
from broker.errors import BrokerUnavailable
from hermes_gateway.client import Gateway
from workers import runfiles
from workers.pool import spawn, stop_all


def connect_local(settings: Settings) -> tuple[BrokerHandle, runfiles.LocalBroker | None]:
    """The broker of a command, as the module says, and the ``serve``/``worker`` it belongs to if attached
    (a process in the run registry itself owns its broker: it never attaches to another's)."""
    url = settings.broker.url
    if url is None:
        attached = _attach(settings)
        if attached is not None:
            return attached
    return connect(url), None


def _attach(settings: Settings) -> tuple[BrokerHandle, runfiles.LocalBroker] | None:
    """The embedded broker of the serve/worker of ``settings.home`` running here, if one answers."""
    if runfiles.enabled() is not None:
        return None  # a serve/worker owns its broker
    for found in runfiles.embedded_brokers(settings.home):
        try:
            conn = from_url(found.url)
        except BrokerUnavailable:
            continue  # it is stopping, or its socket is gone: the next one
        return BrokerHandle(conn, found.url, found.describe()), found
    return None


def connect_shared(settings: Settings) -> BrokerHandle:
    """A broker that outlives this command (the URL, else an attached one, noted on stderr): for commands
    whose subject lives in a running gateway's broker (audit log, active policy, control messages)."""
    url = settings.broker.url
    if url:
        return connect(url)
    attached = _attach(settings)
    if attached is None:
        raise BrokerUnavailable(
            f"{URL_ENV} is not set and no `hermes-gateway serve` or `worker` of {settings.home} runs here"
        )
    from hermes_gateway.cli.common import note

    note(f"broker: {attached[1].describe()}")
    return attached[0]


def throwaway(gw: Gateway) -> bool:
    """True when the gateway's broker is this command's own embedded one: what it holds ends with it."""
    return gw.broker.embedded is not None and runfiles.enabled() is None


THROWAWAY_NOTE = (
    "the embedded broker lasts only for this command (no HERMES_REDIS_URL, and no `hermes-gateway serve` or "
    "`worker` of {home} runs here)"
)


@contextlib.contextmanager
def local_stack(
    settings: Settings, *, queues: tuple[str, ...] = ("tools", "llm"), processes: int = 1,
    concurrency: int = 16, need_workers: bool = True, worker_stdout: Any = None,
) -> Iterator[tuple[Gateway, list[Any]]]:
    """Connect as ``connect_local`` does, and yield the gateway with the worker processes started for it:
    none on a shared broker; on an attached one only for queues no live worker listens on (noted on
    stderr). They die with this process; ``worker_stdout`` is where their output goes."""
    handle, attached = connect_local(settings)
    gw = Gateway(handle, settings)
    procs: list[Any] = []
    try:
        if need_workers and attached is not None:
            queues = tuple(q for q in queues if not gw.live_workers(q))
        if need_workers and queues and (handle.embedded is not None or attached is not None):
            procs = start_workers(handle.url, settings, queues, processes, concurrency, worker_stdout)
            if attached is None:
                wait_for_heartbeats(gw, len(procs))
            else:  # (others' workers are there too: wait until each queue has one)
                wait_for_heartbeats(gw, 1, queues=queues)
        if attached is not None:
            extra = f"; no worker listens on {','.join(queues)}: started {len(procs)} for this command"
            from hermes_gateway.cli.common import note

            note(f"broker: {attached.describe()}{extra if procs else ''}")
        yield gw, procs
    finally:
        stop_all(procs)
        gw.close()


def start_workers(
    url: str, settings: Settings, queues: tuple[str, ...], processes: int = 1, concurrency: int = 16,
    worker_stdout: Any = None,
) -> list[Any]:
    """Worker processes of this process on ``url`` (they die with it, even when it is killed)."""
    from workers.policy import Policy

    Policy.from_settings(settings.policy)  # a bad policy: a clear error now, not a worker that dies
    # (the command's output stays clean: its workers log warnings and errors only unless a level was asked
    # for; a warning is what a plugin author needs to see, as a middleware that failed open)
    asked = settings.logging
    level = asked.worker_level or (asked.level if asked.level_set else "WARNING")
    env = dict(os.environ, HERMES_LOG_LEVEL=level)  # a child process's environment: ours, with its level
    if logs.json_lines():
        env["HERMES_LOG_FORMAT"] = "json"
    env["HERMES_HOME"] = str(settings.home)  # the same config, and the same run registry, as ours
    return [
        spawn(url, list(queues), concurrency, env=env, stdout=worker_stdout, with_parent=True)
        for _ in range(processes)
    ]


def wait_for_heartbeats(
    gw: Gateway, count: int, timeout: float = 30.0, queues: tuple[str, ...] | None = None
) -> None:
    """Until ``count`` workers beat (with ``queues``: ``count`` on each of them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(len(gw.live_workers(q)) >= count for q in (queues or (None,))):
            return
        time.sleep(0.05)
    raise BrokerUnavailable(f"worker processes did not start within {timeout:g}s")


def watch_control_stop(conn: redis.Redis, on_stop: Callable[[], None]) -> threading.Thread:
    """Call ``on_stop`` once when a stop for everyone (``stop --all``) comes on the control channel, in a
    daemon thread that ends with the connection."""

    def listen() -> None:
        pubsub = subscriber(conn)
        try:
            pubsub.subscribe(keys.channel(conn, keys.CONTROL_CHANNEL))
            for msg in pubsub.listen():
                try:
                    data = unpack(msg["data"])
                except Exception:  # noqa: BLE001 - garbage on the channel is ignored
                    continue
                if isinstance(data, dict) and data.get("op") == "stop" and not data.get("worker"):
                    on_stop()
                    return
        except (redis.RedisError, OSError, ValueError):
            return  # the broker went away (it is stopping with us): nothing more to hear
        finally:
            with contextlib.suppress(Exception):
                pubsub.close()

    thread = threading.Thread(target=listen, name="hermes-serve-control", daemon=True)
    thread.start()
    return thread
