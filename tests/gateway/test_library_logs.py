"""redis-py's own log records (a cluster failover makes it log ``shard subscription reconciliation
failed`` with a traceback) reach a client's or worker's stderr as one line at WARNING, no traceback
(issue 31.6). Real processes: what Python prints when the application configured no logging."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, Home

# redis-py's own code path: the callback its cluster pub/sub gives a failed reconciliation.
FAILOVER = """
from concurrent.futures import Future
from redis.cluster import ClusterPubSub
from redis.exceptions import ConnectionError
f = Future()
f.set_exception(ConnectionError("Error 111 connecting to 127.0.0.1:7001. Connection refused."))
ClusterPubSub._log_reconcile_future_exception(f)
"""


def _stderr(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stderr


def _one_warning(stderr: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "reconciliation failed" in lines[0] and "ConnectionError" in lines[0], lines
    assert "warning" in lines[0].lower() and "ERROR" not in lines[0] and "[error" not in lines[0], lines
    assert "Traceback" not in stderr


def test_a_python_client_prints_redis_pys_failover_record_as_one_warning_line(redis_url: str, home: Home) -> None:
    code = f"""
from hermes_gateway.client import Gateway
gw = Gateway.connect({redis_url!r}, home={str(home.path)!r}, embedded_ok=False)
{FAILOVER}
gw.close()
"""
    _one_warning(_stderr(code))


def test_an_asyncio_client_prints_it_as_one_warning_line_too(redis_url: str, home: Home) -> None:
    code = f"""
import asyncio
from hermes_gateway.aio import AsyncGateway

async def main():
    agw = await AsyncGateway.connect({redis_url!r}, home={str(home.path)!r})
    {FAILOVER.strip().replace(chr(10), chr(10) + '    ')}
    await agw.close()

asyncio.run(main())
"""
    _one_warning(_stderr(code))


def test_a_worker_or_command_with_our_logging_prints_it_as_one_warning_line() -> None:
    code = f"""
from broker.logs import configure
configure("INFO", "console")
{FAILOVER}
"""
    _one_warning(_stderr(code))


def test_an_application_with_logging_of_its_own_keeps_its_say(redis_url: str, home: Home) -> None:
    code = f"""
import logging, sys
logging.basicConfig(stream=sys.stderr, format="APP %(levelname)s %(name)s %(message)s")
from hermes_gateway.client import Gateway
gw = Gateway.connect({redis_url!r}, home={str(home.path)!r}, embedded_ok=False)
{FAILOVER}
gw.close()
"""
    err = _stderr(code)
    assert err.count("APP ERROR redis.cluster shard subscription reconciliation failed") == 1, err
