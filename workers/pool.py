"""Running a worker: one process in the foreground, or a supervisor over several."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

import structlog

from broker.config import Settings
from broker.connection import from_url
from broker.embedded import die_with_parent
from broker.errors import BrokerUnavailable, ConfigError
from workers import runfiles

log = structlog.get_logger("hermes.pool")


# Python's default (700, 10, 10) collects the young generation every 700 container allocations. A worker
# allocates thousands per second and keeps each call's objects alive for the call's duration, so most of
# them were scanned and promoted before they died; measured on io_bound, a higher threshold gained ~5%
# efficiency (4 of 4 interleaved pairs). Reference counting still frees everything that is not a cycle.
GC_THRESHOLD = (50_000, 20, 10)
GC_ENV = "HERMES_GC_THRESHOLD"


def gc_threshold(environ: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
    """The thresholds ``HERMES_GC_THRESHOLD`` asks for ("N[,N[,N]]"; "default": Python's own, None),
    else ``GC_THRESHOLD``; a malformed value is a ConfigError naming the variable."""
    raw = (os.environ if environ is None else environ).get(GC_ENV, "").strip()
    if raw.lower() == "default":
        return None
    if not raw:
        return GC_THRESHOLD
    try:
        wanted = tuple(int(part) for part in raw.split(","))
    except ValueError:
        wanted = ()
    # A first value of 0 would switch automatic collection off: cycles would never be freed.
    if not 1 <= len(wanted) <= 3 or wanted[0] < 1 or any(n < 0 for n in wanted):
        raise ConfigError(
            f"{GC_ENV} must be one to three integers like '50000,20,10' (the first at least 1), "
            f"or 'default' for Python's own; got {raw!r}"
        )
    return wanted


def tune_gc(environ: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
    """Set this worker process's garbage-collector thresholds (``gc_threshold``); returns what was set."""
    wanted = gc_threshold(environ)
    if wanted is not None:
        gc.set_threshold(*wanted)
    return wanted


def run_worker(url: str, settings: Settings, queues: list[str], concurrency: int, grace: float) -> int:
    """Run one worker in this process until it is stopped."""
    from workers.stopping import install_signals
    from workers.worker import Worker

    tune_gc()
    port = os.environ.get(METRICS_PORT_ENV)
    if port:  # before the worker sets up OpenTelemetry: its meter provider gets the Prometheus reader
        from workers import otelsdk

        otelsdk.serve_prometheus(int(port), os.environ.get(METRICS_HOST_ENV) or "127.0.0.1")
    conn = from_url(url)
    worker = Worker(conn, settings, queues, concurrency=concurrency, grace=grace)
    install_signals(worker.request_stop)
    # Recorded for `hermes-gateway stop --all` when a `worker` command started it (it sets the variable);
    # the private worker of a `tool run` or a `chat` is its command's to stop, not stop --all's.
    if os.environ.get(runfiles.ENV):
        runfiles.enable(settings.home)
    with runfiles.registered("worker", url=url):
        worker.work()
    return 0


METRICS_PORT_ENV = "HERMES_METRICS_PORT"  # /metrics of a worker process (`worker --metrics-port`)
METRICS_HOST_ENV = "HERMES_METRICS_HOST"


def metrics_env(index: int) -> dict[str, str] | None:
    """The environment of pool child ``index``: with ``$HERMES_METRICS_PORT`` P, it serves /metrics on P+index."""
    port = os.environ.get(METRICS_PORT_ENV)
    if not port:
        return None
    return dict(os.environ, **{METRICS_PORT_ENV: str(int(port) + index)})


def worker_argv(queues: list[str], concurrency: int, grace: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "workers",
        "--queues",
        ",".join(queues),
        "--concurrency",
        str(concurrency),
        "--grace",
        str(grace),
    ]


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
    """Start one worker process on ``url`` (``stdout``: where its standard output goes, as for Popen;
    ``with_parent``: it is sent SIGTERM when the process that started it dies, even by SIGKILL, and it
    runs in a process group of its own: Ctrl-C at a terminal reaches only the command, which stops its
    workers while their broker is still up, instead of every process of the group at once)."""
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


def supervise(url: str, queues: list[str], concurrency: int, processes: int, grace: float) -> int:
    """Start ``processes`` workers, restart any that crash, pass SIGTERM/SIGINT on, wait for all."""
    if not url:
        raise BrokerUnavailable("worker pools need a broker URL")
    gc_threshold()  # a bad value is reported once here, not by every child the pool would restart
    children = [spawn(url, queues, concurrency, grace, env=metrics_env(i)) for i in range(processes)]
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
                        stopping = True
                        on_term(signal.SIGTERM, None)
                        continue
                    restarts.append(now)
                    log.warning("worker process exited; restarting", exit_code=code, pid=child.pid)
                    children[i] = spawn(url, queues, concurrency, grace, env=metrics_env(i))
                    alive = True
            if not alive:
                return 0
            time.sleep(0.2)
    finally:
        runfiles.unregister(runfile)
