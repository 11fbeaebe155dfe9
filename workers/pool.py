"""Running a worker: one process in the foreground, or a supervisor over several."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from typing import Any

import structlog

from broker.config import METRICS_HOST_ENV, METRICS_PORT_ENV, Settings, WorkerSettings
from broker.connection import from_url
from broker.embedded import die_with_parent
from broker.errors import BrokerUnavailable
from workers import runfiles

log = structlog.get_logger("hermes.pool")


def tune_gc(threshold: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """Set this process's GC thresholds (``settings.workers.gc_threshold``; None: Python's own)."""
    if threshold is not None:
        gc.set_threshold(*threshold)
    return threshold


def run_worker(url: str, settings: Settings, queues: list[str], concurrency: int, grace: float) -> int:
    """Run one worker in this process until it is stopped."""
    from workers.stopping import install_signals
    from workers.worker import Worker

    tune_gc(settings.workers.gc_threshold)
    port = settings.workers.metrics_port
    if port:  # before the worker sets up OpenTelemetry: its meter provider gets the Prometheus reader
        from workers import otelsdk

        otelsdk.serve_prometheus(port, settings.workers.metrics_host)
    conn = from_url(url)
    worker = Worker(conn, settings, queues, concurrency=concurrency, grace=grace)
    install_signals(worker.request_stop)
    # Recorded for `hermes-gateway stop --all` when a `worker` command started it, not for the private
    # worker of a `tool run` or a `chat`.
    if settings.workers.run_registry:
        runfiles.enable(settings.home)
    with runfiles.registered("worker", url=url):
        worker.work()
    return 0


def metrics_env(index: int, workers: WorkerSettings) -> dict[str, str] | None:
    """The environment of pool child ``index``: with a metrics port P, it serves /metrics on P+index."""
    if not workers.metrics_port:
        return None
    port = {METRICS_PORT_ENV: str(workers.metrics_port + index), METRICS_HOST_ENV: workers.metrics_host}
    return dict(os.environ, **port)


def worker_argv(queues: list[str], concurrency: int, grace: float) -> list[str]:
    options = ["--queues", ",".join(queues), "--concurrency", str(concurrency), "--grace", str(grace)]
    return [sys.executable, "-m", "workers", *options]


def spawn(
    url: str,
    queues: list[str],
    concurrency: int,
    grace: float = 25.0,
    env: dict[str, str] | None = None,
    *,
    stdout: Any = None,
    with_parent: bool = False,
) -> subprocess.Popen[Any]:
    """Start one worker process on ``url``.

    ``with_parent``: it gets SIGTERM when its parent dies (even by SIGKILL) and runs in its own process
    group, so Ctrl-C reaches only the command, which stops its workers while their broker is still up.
    """
    child_env = dict(os.environ if env is None else env)
    child_env["HERMES_REDIS_URL"] = url
    return subprocess.Popen(
        worker_argv(queues, concurrency, grace),
        env=child_env,
        stdout=stdout,
        preexec_fn=die_with_parent if with_parent else None,  # noqa: PLW1509 - prctl only, no locks taken
        process_group=0 if with_parent else None,
    )


def stop_all(procs: list[subprocess.Popen[Any]], timeout: float = 30.0) -> None:
    """SIGTERM every process, then wait; SIGKILL what is still there after ``timeout``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def supervise(
    url: str, queues: list[str], concurrency: int, processes: int, grace: float, workers: WorkerSettings
) -> int:
    """Start ``processes`` workers, restart any that crash, pass SIGTERM/SIGINT on, wait for all."""
    if not url:
        raise BrokerUnavailable("worker pools need a broker URL")
    children = [spawn(url, queues, concurrency, grace, env=metrics_env(i, workers)) for i in range(processes)]
    stopping = False

    def on_term(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    log.info("worker pool started", processes=processes, concurrency=concurrency, queues=queues)
    restarts: list[float] = []
    runfile = runfiles.register("pool", url=url)  # when the command enabled the run registry
    try:
        while True:
            alive = False
            for i, child in enumerate(children):
                code = child.poll()
                if code is None:
                    alive = True
                    continue
                if not stopping and code != 0:
                    now = time.monotonic()
                    restarts[:] = [t for t in restarts if now - t < 60]
                    if len(restarts) >= 10 * processes:
                        log.error("workers keep crashing; giving up", exit_code=code)
                        on_term(signal.SIGTERM, None)  # (sets stopping)
                        continue
                    restarts.append(now)
                    log.warning("worker process exited; restarting", exit_code=code, pid=child.pid)
                    children[i] = spawn(url, queues, concurrency, grace, env=metrics_env(i, workers))
                    alive = True
            if not alive:
                return 0
            time.sleep(0.2)
    finally:
        runfiles.unregister(runfile)
