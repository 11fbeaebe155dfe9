"""A real 3-primary Redis Cluster on free loopback ports, started and stopped by the tests.

``start_cluster(workdir)`` starts three ``redis-server --cluster-enabled yes`` processes (nothing on disk
but their nodes.conf), joins them with ``redis-cli --cluster create --cluster-replicas 0`` and waits for
``cluster_state:ok``; ``Cluster.stop()`` ends them by PID.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


def free_port() -> int:
    """A free loopback port P with P + 10000 free too (a cluster node's bus port), P <= 55535."""
    while True:
        port = random.randint(20000, 45000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


@dataclass
class Cluster:
    ports: list[int]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port)

    def slot_owner(self, slot: int) -> int:
        """The port of the primary serving ``slot``."""
        for lo, hi, primary, *_ in self.node(self.ports[0]).execute_command("CLUSTER SLOTS"):
            if lo <= slot <= hi:
                return int(primary[1])
        raise LookupError(slot)

    def node_id(self, port: int) -> str:
        return self.node(port).execute_command("CLUSTER MYID").decode()

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def start_cluster(workdir: Path, primaries: int = 3) -> Cluster:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        raise RuntimeError("redis-server and redis-cli (Redis 7+) are needed for the cluster tests")
    cluster = Cluster([free_port() for _ in range(primaries)])
    try:
        for port in cluster.ports:
            d = workdir / str(port)
            d.mkdir(parents=True)
            cluster.procs.append(
                subprocess.Popen(
                    [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                     "--cluster-config-file", "nodes.conf", "--dir", str(d), "--save", "", "--appendonly", "no",
                     "--cluster-node-timeout", "2000"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for port in cluster.ports:
            _wait(lambda p=port: _pings(p), 10, f"redis-server on {port}")
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=30,
        )
        for port in cluster.ports:
            _wait(lambda p=port: _state(cluster.node(p)) == "ok", 15, "cluster_state:ok")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _state(node: redis.Redis) -> str:
    info = node.execute_command("CLUSTER INFO")  # (redis-py parses it into a dict)
    state = info.get("cluster_state") if isinstance(info, dict) else None
    return state.decode() if isinstance(state, bytes) else str(state)


def _pings(port: int) -> bool:
    try:
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


def _wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def migrate_slot(cluster: Cluster, slot: int, dest_port: int) -> int:
    """Move ``slot`` (and its keys) to the primary on ``dest_port`` as ``redis-cli --cluster reshard``
    does (SETSLOT IMPORTING / MIGRATING, MIGRATE in batches, SETSLOT NODE everywhere); returns keys moved."""
    src_port = cluster.slot_owner(slot)
    if src_port == dest_port:
        return 0
    src, dst = cluster.node(src_port), cluster.node(dest_port)
    src_id, dst_id = cluster.node_id(src_port), cluster.node_id(dest_port)
    dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    moved = 0
    while True:
        names = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 50)
        if not names:
            break
        src.execute_command("MIGRATE", "127.0.0.1", dest_port, "", 0, 5000, "REPLACE", "KEYS", *names)
        moved += len(names)
        time.sleep(0.01)  # the calls go on meanwhile
    for port in cluster.ports:
        cluster.node(port).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    return moved
