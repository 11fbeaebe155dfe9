"""A broker and workers for the duration of one command, when no ``HERMES_REDIS_URL`` is set."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from broker.config import Settings
from broker.connection import BrokerHandle, connect
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
) -> Iterator[tuple[Gateway, list[Any]]]:
    """Connect to ``HERMES_REDIS_URL``; without one, start the embedded broker and worker processes.

    Yields the gateway and the worker processes this context started (none on a shared broker).
    """
    handle: BrokerHandle = connect(settings.redis_url)
    gw = Gateway(handle, settings)
    procs: list[Any] = []
    try:
        if handle.embedded is not None and need_workers:
            env = dict(os.environ, HERMES_LOG_LEVEL=os.environ.get("HERMES_WORKER_LOG_LEVEL", "ERROR"))
            procs = [spawn(handle.url, list(queues), concurrency, env=env) for _ in range(processes)]
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
