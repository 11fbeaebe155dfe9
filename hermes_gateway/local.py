"""A broker and workers for the duration of one command, when no ``HERMES_REDIS_URL`` is set."""

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
from broker.connection import BrokerHandle, connect, subscriber
from broker.errors import BrokerUnavailable
from hermes_gateway.client import Gateway
from workers.pool import spawn, stop_all


@contextlib.contextmanager
def local_stack(
    settings: Settings,
    *,
    queues: tuple[str, ...] = ("tools", "llm"),
    processes: int = 1,
    concurrency: int = 16,
    need_workers: bool = True,
    worker_stdout: Any = None,
) -> Iterator[tuple[Gateway, list[Any]]]:
    """Connect to ``HERMES_REDIS_URL``; without one, start the embedded broker and worker processes.

    Yields the gateway and the worker processes this context started (none on a shared broker). They die
    with this process, like its embedded broker, even when it is killed; ``worker_stdout`` is where their
    standard output goes (``mcp serve`` keeps its own for the protocol).
    """
    handle: BrokerHandle = connect(settings.redis_url)
    gw = Gateway(handle, settings)
    procs: list[Any] = []
    try:
        if handle.embedded is not None and need_workers:
            from workers.policy import Policy

            Policy.from_settings(settings.policy)  # a bad policy: a clear error now, not a worker that dies
            # The command's own output stays clean: its workers log errors only, unless DEBUG was asked for
            # (`logging.level: DEBUG`, `--log-level DEBUG`); they log in the command's format (JSON lines too).
            level = os.environ.get("HERMES_WORKER_LOG_LEVEL") or ("DEBUG" if logs.debug_enabled() else "ERROR")
            env = dict(os.environ, HERMES_LOG_LEVEL=level)
            if logs.json_lines():
                env["HERMES_LOG_FORMAT"] = "json"
            env["HERMES_HOME"] = str(settings.home)  # the same config, and the same run registry, as ours
            procs = [
                spawn(handle.url, list(queues), concurrency, env=env, stdout=worker_stdout, with_parent=True)
                for _ in range(processes)
            ]
            wait_for_heartbeats(gw, len(procs))
        yield gw, procs
    finally:
        stop_all(procs)
        gw.close()


def wait_for_heartbeats(gw: Gateway, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(gw.live_workers()) >= count:
            return
        time.sleep(0.05)
    raise BrokerUnavailable(f"worker processes did not start within {timeout:g}s")


def watch_control_stop(conn: redis.Redis, on_stop: Callable[[], None]) -> threading.Thread:
    """Call ``on_stop`` once when a stop for everyone (``hermes-gateway stop --all``) arrives on the
    broker's control channel, as workers obey it; a stop naming one worker is not for us. A daemon thread
    that ends with the connection."""

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
