"""Shared set-up for benchmarks: a broker URL, a scratch HERMES_HOME, worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
# Where benchmarks write their JSON results; the tests point it at a scratch directory.
RESULTS = Path(os.environ.get("HERMES_BENCH_RESULTS") or ROOT / "bench" / "results")


def commit() -> str:
    """The checkout's commit, for a result file ('' outside a git checkout; ``+dirty`` when the tree has
    changes not committed: the figures are then not that commit's)."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

        return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return ""


def shown(path: Path) -> str:
    """A result file's path as printed: relative to the checkout when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@contextmanager
def using_broker(arg: str | None) -> Iterator[str]:
    """The Redis URL to use: ``arg``, else ``$HERMES_REDIS_URL``, else an embedded broker run for the block."""
    url = arg or os.environ.get("HERMES_REDIS_URL")
    if url:
        yield url
        return
    from broker.embedded import EmbeddedBroker

    emb = EmbeddedBroker().start()
    try:
        yield emb.url
    finally:
        emb.stop()


def scratch_home(tools: list[dict[str, Any]], config: dict[str, Any] | None = None) -> Path:
    home = Path(tempfile.mkdtemp(prefix="hermes-bench-"))
    (home / "tools").mkdir()
    for spec in tools:
        (home / "tools" / f"{spec['name']}.yaml").write_text(yaml.safe_dump(spec))
    if config:
        (home / "config.yaml").write_text(yaml.safe_dump(config))
    return home


def start_workers(
    url: str,
    home: Path,
    queue: str,
    processes: int,
    concurrency: int,
    extra_env: dict[str, str] | None = None,
    log_level: str = "INFO",
) -> list[subprocess.Popen[bytes]]:
    """``processes`` worker processes on ``queue``, ``concurrency`` call slots each.

    At the default log level, as users run them (two lines a call), written to ``<home>/workers.log`` as a
    log file or a container's log pipe would take them, not to the terminal running the benchmark.
    """
    # Results of a benchmark are not kept for a day: repeated runs would grow the Redis they measure.
    env = dict(
        os.environ,
        HERMES_REDIS_URL=url,
        HERMES_HOME=str(home),
        HERMES_LOG_LEVEL=log_level,
        HERMES_RESULT_TTL="600",
        PYTHONPATH=str(ROOT),
    )
    env.update(extra_env or {})
    with (home / "workers.log").open("ab") as log:
        return [
            subprocess.Popen(
                [sys.executable, "-m", "workers", "--queues", queue, "--concurrency", str(concurrency)],
                env=env,
                cwd=ROOT,
                stderr=log,
            )
            for _ in range(processes)
        ]


def start_rq_workers(url: str, queue: str, processes: int, *more: str) -> list[subprocess.Popen[bytes]]:
    """``processes`` stock RQ ``SimpleWorker`` processes on ``queue`` (and the queues ``more``, after it: an
    RQ worker takes from the first queue that has a job)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return [
        subprocess.Popen(
            [sys.executable, "-m", "rq.cli", "worker", "--url", url, "--worker-class", "rq.SimpleWorker", "--quiet", queue, *more],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )
        for _ in range(processes)
    ]


def dramatiq_results(url: str, queue: str, first: str) -> Any:
    """``bench/dramatiq_results.py`` (a sleeping actor whose result is waited for), imported afresh in this
    process for these queue names; ``start_dramatiq`` starts its worker with the same."""
    os.environ.update(BENCH_DRAMATIQ_URL=url, BENCH_DRAMATIQ_QUEUE=queue, BENCH_DRAMATIQ_FIRST=first)
    sys.modules.pop("bench.dramatiq_results", None)
    import bench.dramatiq_results as actors

    return actors


def start_dramatiq(url: str, queue: str, first: str, threads: int, timeout: float = 60.0) -> list[subprocess.Popen[bytes]]:
    """One Dramatiq worker process with ``threads`` threads on ``bench/dramatiq_results.py``'s two queues,
    returned once it says it is ready (as ``wait_for_workers`` waits for ours and RQ's; its log, one per
    process, under ``$TMPDIR``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), BENCH_DRAMATIQ_URL=url, BENCH_DRAMATIQ_QUEUE=queue, BENCH_DRAMATIQ_FIRST=first)
    cmd = [sys.executable, "-m", "dramatiq", "bench.dramatiq_results", "--processes", "1", "--threads", str(threads)]
    path = Path(tempfile.mkstemp(prefix=f"{queue}-", suffix=".log", dir=os.environ.get("TMPDIR", "/tmp"))[1])
    with path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=log)
    deadline = time.monotonic() + timeout
    while b"ready for action" not in path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop([proc])
            raise RuntimeError(f"Dramatiq did not start: {path}")
        time.sleep(0.05)
    return [proc]


def stop(procs: list[subprocess.Popen[bytes]], again: float | None = None) -> None:
    """SIGTERM the processes still running, SIGKILL those left after 30 s; ``again``: SIGTERM the ones
    still running every ``again`` seconds meanwhile."""
    pending = [p for p in procs if p.poll() is None]
    for p in pending:
        p.terminate()
    deadline = time.monotonic() + 30
    resend = time.monotonic() + again if again else deadline
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = [p for p in pending if p.poll() is None]
        if again and time.monotonic() >= resend:
            for p in pending:
                p.terminate()
            resend += again
    for p in pending:
        p.kill()
        p.wait()


def stop_rq(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop stock RQ worker processes: ``stop`` with a SIGTERM again every 1.5 s.

    RQ 3.0 on redis-py 8.2 may hang up to 60 s at the end of its warm shutdown (the first SIGTERM: the
    worker deregisters): its pubsub thread, once unsubscribed, waits out a 60 s ``get_message`` before
    ``PubSubWorkerThread.stop`` returns. A second SIGTERM at least 1 s after the first is RQ's cold
    shutdown, which ends the process there (one sooner is ignored)."""
    stop(procs, again=1.5)


def wait_for_workers(conn: Any, count: int, queue: str, timeout: float = 20.0) -> None:
    """Until ``count`` workers listen on ``queue``: stock RQ's (RQ's registry) or ours (their heartbeats)."""
    from broker import keys

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(conn.scard(f"rq:workers:{queue}"), conn.zcard(keys.queue_workers(queue))) >= count:
            return
        time.sleep(0.05)
    raise RuntimeError(f"workers did not start on {queue}")


class Peak:
    """The highest value ``sample()`` returns, sampled every ``every`` seconds on a thread while the block
    runs (``value``; read it after the block)."""

    def __init__(self, sample: Callable[[], int], every: float) -> None:
        self.sample, self.every, self.value = sample, every, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._done.is_set():
            self.value = max(self.value, int(self.sample()))
            time.sleep(self.every)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
