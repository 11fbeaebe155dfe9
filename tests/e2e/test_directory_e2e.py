"""A directory change reaches real worker processes at once, and no call runs against an older spec."""

from __future__ import annotations

import sys
from typing import Any

import redis

from broker import keys
from broker.codec import pack
from broker.directory import Directory
from broker.errors import UnknownTool
from workers.specs import check_spec


def _version_tool(n: int) -> dict[str, Any]:
    # The command prints the spec's own generation, so the result names the spec the worker ran.
    return {
        "name": "which",
        "executor": "command",
        "command": [sys.executable, "-c", f"print('v{n}')"],
        "timeout": 10,
    }


def test_every_call_after_an_update_runs_the_new_spec(gateway: Any, workers: Any) -> None:
    workers(1)
    gateway.register_tool(_version_tool(0))
    assert gateway.call_tool("which").result(20) == "v0"  # the worker has v0 cached now
    for n in range(1, 8):
        version = gateway.register_tool(_version_tool(n))
        handle = gateway.call_tool("which")
        assert handle.result(20) == f"v{n}", f"update {n} (directory version {version}) ran a stale spec"


def test_a_worker_that_missed_the_change_notice_still_refetches_the_newer_spec(
    gateway: Any, workers: Any, conn: redis.Redis
) -> None:
    workers(1)
    gateway.register_tool(_version_tool(1))
    assert gateway.call_tool("which").result(20) == "v1"
    # Write version 2 the way the directory does, but publish nothing: the worker's cache is stale.
    spec = check_spec(_version_tool(2))
    version = int(conn.incr(keys.TOOLS_VERSION))
    pipe = conn.pipeline()
    pipe.hset(keys.TOOLS, spec.name, pack(spec.to_dict()))
    pipe.hset(keys.TOOLS + ":digest", spec.name, spec.digest())
    pipe.hset(keys.TOOLS + ":ver", spec.name, version)
    pipe.execute()
    gateway.directory.invalidate("which")  # the caller must see it to stamp the envelope
    handle = gateway.call_tool("which")
    assert handle.result(20) == "v2"  # the envelope's tool_version made the worker refetch


def test_another_client_sees_changes_and_removals_over_pub_sub(
    gateway: Any, redis_url: str, wait_until: Any
) -> None:
    other = Directory(redis.Redis.from_url(redis_url))
    other.register(check_spec(_version_tool(1)))
    assert gateway.tool("which").spec.config["command"][-1] == "print('v1')"  # cached from here on
    other.register(check_spec(_version_tool(2)))
    wait_until(
        lambda: gateway.tool("which").spec.config["command"][-1] == "print('v2')", message="the notice"
    )
    other.remove("which")

    def gone() -> bool:
        try:
            gateway.tool("which")
        except UnknownTool:
            return True
        return False

    wait_until(gone, message="the removal notice")
