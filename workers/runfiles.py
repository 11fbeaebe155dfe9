"""This machine's run registry: the long-running processes our commands started, one JSON file each.

``$HERMES_HOME/run/<kind>-<pid>.json`` holds ``{pid, kind, started, proc_start, parent, url, port, host}``
of a ``serve``, worker, worker pool or embedded broker while it runs. ``stop --all`` stops what it lists,
checking each pid is still the process recorded (start time, command line); a command without
``HERMES_REDIS_URL`` finds the embedded broker of the gateway running here through it. Registration is
opt-in per process (``enable``): the embedded broker of a mere ``Gateway.connect()`` is not recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from broker import embedded
from broker.config import hermes_home
from broker.connection import redact_url

RUN_DIR = "run"
# What the command line of each kind contains; without any of its kind's markers, a pid is not ours any more.
MARKERS: dict[str, tuple[str, ...]] = {
    "serve": ("hermes-gateway", "hermes_gateway"),
    "worker": ("hermes-gateway", "hermes_gateway", "workers"),
    "pool": ("hermes-gateway", "hermes_gateway", "workers"),
    "broker": ("redis-server",),
}

_run_dir: Path | None = None


def run_dir(home: str | os.PathLike[str] | None = None) -> Path:
    return hermes_home(home) / RUN_DIR


def enable(home: str | os.PathLike[str] | None = None) -> Path:
    """Record this process's long-running processes (itself, its embedded broker) under ``home``'s run dir."""
    global _run_dir
    _run_dir = run_dir(home)
    embedded.on_start = _record_broker
    return _run_dir


def _record_broker(pid: int, url: str) -> Callable[[], None]:
    path = register("broker", pid=pid, parent=os.getpid(), url=url)
    return lambda: unregister(path)


def enabled() -> Path | None:
    return _run_dir


_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)  # exited, not yet waited for by its parent


def _since_boot(proc: psutil.Process) -> float:
    """Seconds from boot to the process's start (unlike its start time of day, no clock change moves it)."""
    return round(proc.create_time() - psutil.boot_time(), 2)


def proc_start(pid: int) -> float | None:
    try:
        return _since_boot(psutil.Process(pid))
    except psutil.Error:
        return None


def alive(pid: int) -> bool:
    """The pid exists and is not a zombie (an exited child its parent has not waited for yet)."""
    try:
        return psutil.Process(pid).status() not in _GONE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # someone else's process: alive, but never ours (see ``Entry.is_ours``)


@dataclass
class Entry:
    """One run file."""

    path: Path
    pid: int
    kind: str
    started: float = 0.0
    proc_start: float | None = None  # seconds from boot to its start
    parent: int | None = None
    url: str | None = None
    port: int | None = None
    host: str | None = None

    def describe(self) -> str:
        where = f" on http://{self.host or '127.0.0.1'}:{self.port}/" if self.port else ""
        broker = f" ({self.url})" if self.url and self.kind == "broker" else ""
        return f"{self.kind}{where}{broker} pid {self.pid}"

    def is_ours(self) -> bool:
        """Alive and still the process that wrote this file (same start time, a command line of its kind)."""
        try:
            os.kill(self.pid, 0)  # (gone, or another user's process: not ours)
            proc = psutil.Process(self.pid)
            if proc.status() in _GONE:
                return False
            if isinstance(self.proc_start, float) and _since_boot(proc) != self.proc_start:
                return False
            line = " ".join(proc.cmdline())
        except (OSError, psutil.Error):
            return False
        return any(m in line for m in MARKERS.get(self.kind, ()))


def _write(path: Path, data: dict[str, Any]) -> None:
    # Only the owner reads the registry (it names our processes and their brokers).
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)  # (also an existing directory)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover keeps its old mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=1))
    os.replace(tmp, path)


def register(
    kind: str,
    *,
    pid: int | None = None,
    parent: int | None = None,
    url: str | None = None,
    port: int | None = None,
    host: str | None = None,
    directory: Path | None = None,
) -> Path | None:
    """Record a process (this one unless ``pid``) in the enabled run dir (or ``directory``); its path, or
    None when registration is not enabled in this process. Never raises on a full or read-only disk."""
    target = directory or _run_dir
    if target is None:
        return None
    pid = os.getpid() if pid is None else pid
    data = {
        "pid": pid,
        "kind": kind,
        "started": time.time(),
        "proc_start": proc_start(pid),
        "parent": os.getppid() if parent is None and pid == os.getpid() else parent,
        "url": redact_url(url) if url else url,  # never a password on disk
        "port": port,
        "host": host,
    }
    path = target / f"{kind}-{pid}.json"
    try:
        _write(path, data)
    except OSError:
        return None
    return path


def unregister(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def registered(kind: str, **fields: Any) -> Iterator[Path | None]:
    """``register`` for the duration of the block (nothing when registration is not enabled)."""
    path = register(kind, **fields)
    try:
        yield path
    finally:
        unregister(path)


def entries(home: str | os.PathLike[str] | None = None) -> list[Entry]:
    """Every run file of ``home`` that parses (unreadable ones are removed: nothing could use them)."""
    root = run_dir(home)
    found: list[Entry] = []
    for path in sorted(root.glob("*.json")) if root.is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            pid, kind, started = int(data["pid"]), str(data["kind"]), float(data.get("started") or 0.0)
            rest = {k: data.get(k) for k in ("proc_start", "parent", "url", "port", "host")}
            found.append(Entry(path, pid, kind, started, **rest))
        except (OSError, ValueError, KeyError, TypeError):
            unregister(path)
    return found


# The processes whose embedded broker a command may use, in the order they are preferred.
OWNERS = ("serve", "pool", "worker")


@dataclass
class LocalBroker:
    """The embedded broker of a ``serve`` or ``worker`` running here, as its run files record it."""

    owner: Entry
    broker: Entry
    url: str  # unix:///.../redis.sock (no password: the embedded broker has none)

    def describe(self) -> str:
        return f"the embedded broker of {self.owner.kind} (pid {self.owner.pid}) at {self.url}"


def embedded_brokers(home: str | os.PathLike[str] | None = None) -> list[LocalBroker]:
    """The embedded brokers of the live ``serve``/``worker`` processes of ``home``, serve first, then the
    newest; whether the socket answers is for the caller to check (PING)."""
    found = entries(home)
    owners = {e.pid: e for e in found if e.kind in OWNERS}
    out: list[LocalBroker] = []
    for entry in found:
        url = entry.url or ""
        owner = owners.get(entry.parent) if entry.parent is not None else None
        if entry.kind != "broker" or owner is None or not url.startswith("unix://") or "@" in url:
            continue
        if not Path(url.removeprefix("unix://")).exists() or not (entry.is_ours() and owner.is_ours()):
            continue
        out.append(LocalBroker(owner, entry, url))
    out.sort(key=lambda b: (OWNERS.index(b.owner.kind), -b.owner.started))
    return out


@dataclass
class Outcome:
    entry: Entry
    result: str  # "stopped" (exited after our SIGTERM), "exited" (with its parent), "killed", "stale", "failed"


def stop_all(
    home: str | os.PathLike[str] | None = None,
    grace: float = 10.0,
    report: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Stop every live process of ``home``'s run registry; drop the files of those that are gone.

    A process whose recorded parent runs here gets no signal while that parent lives: the parent stops it
    in order. What has not exited ``grace`` seconds after the first SIGTERM is SIGKILLed.
    """
    outcomes: list[Outcome] = []

    def done(entry: Entry, result: str) -> None:
        unregister(entry.path)
        outcome = Outcome(entry, result)
        outcomes.append(outcome)
        if report is not None:
            report(outcome)

    live: list[Entry] = []
    for entry in entries(home):
        if entry.is_ours():
            live.append(entry)
        else:
            done(entry, "stale")
    signalled: set[int] = set()
    deadline = time.monotonic() + grace
    while live:
        running = {e.pid for e in live}
        still: list[Entry] = []
        for entry in live:
            if entry.pid not in signalled and entry.parent not in running:
                if not entry.is_ours():  # it ended since the first look, and its pid may be another's now
                    done(entry, "exited")
                    continue
                signalled.add(entry.pid)
                try:
                    os.kill(entry.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                except PermissionError:
                    done(entry, "failed")
                    continue
            if alive(entry.pid):
                still.append(entry)
            else:
                done(entry, "stopped" if entry.pid in signalled else "exited")
        live = still
        if not live:
            break
        if time.monotonic() >= deadline:
            for entry in live:
                if entry.is_ours():  # (checked again right before: a pid reused since is never killed)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(entry.pid, signal.SIGKILL)
            for entry in live:
                end = time.monotonic() + 5
                while alive(entry.pid) and time.monotonic() < end:
                    time.sleep(0.02)
                done(entry, "killed" if not alive(entry.pid) else "failed")
            break
        time.sleep(0.05)
    return outcomes
