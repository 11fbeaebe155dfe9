"""The README's Python API as a user meets it: its block run as printed on a fresh HERMES_HOME (no Redis
URL: an embedded broker with a worker of its own), ``Gateway.connect()`` attaching to the ``serve`` of the
same home, and a call refused at once when no worker listens on its queue."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from broker import keys
from broker.errors import NoWorkers
from tests.e2e.test_cli import _env
from tests.e2e.util import free_port, wait_http

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).parent / "hermes-gateway")
HELLO = ROOT / "examples" / "tools" / "hello.yaml"


def readme_python_block() -> str:
    """The first ```python block of the README's "Python API" section, as printed."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Python API") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


def test_the_readmes_python_block_runs_as_printed_without_a_redis_url(home: Any, tmp_path: Path) -> None:
    shutil.copy(HELLO, home.tools_dir / "hello.yaml")  # the quick start's first tool
    script = tmp_path / "example.py"
    script.write_text(readme_python_block(), encoding="utf-8")
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script)], env=_env(home), capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    # The output the README shows under the block, but for the trace id (and the last line, "cancelled",
    # which a call that a warm worker finished before its cancel does not print).
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = re.search(r"It prints[^\n]*\n\n```text\n(.*?)```", text[text.index("## Python API") :], re.S)
    assert shown is not None

    def trace_free(ls: list[str]) -> list[str]:
        return [re.sub(r"[0-9a-f]{32}", "TRACE", line) for line in ls]

    assert trace_free(lines) in (trace_free(shown.group(1).splitlines()), trace_free(shown.group(1).splitlines()[:-1]))
    states = [line.split()[1] for line in lines if re.fullmatch(r"\d+ \w+ [0-9a-f]{32}", line)]
    assert states == ["pending", "routing", "executing", "formatting", "done"], out.stdout
    assert "Hello, Alice!" in lines
    assert "['Hello, Bob!', 'Hello, Carol!', 'Hello, Dave!']" in lines
    assert any(line.startswith("refused: ") for line in lines), out.stdout
    assert time.monotonic() - started < 100
    # Its worker ended with it: nothing of it is left running.
    assert not list((home.path / "run").glob("*.json")) if (home.path / "run").is_dir() else True


def readme_asyncio_block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text[text.index("## Python API") : text.index("## HTTP/SSE API")], re.S)
    return next(b for b in blocks if "AsyncGateway" in b)


def test_the_readmes_asyncio_block_runs_as_printed_without_a_redis_url(home: Any, tmp_path: Path) -> None:
    # As the threaded client: an embedded broker of its own, with a worker started for the call's queue.
    shutil.copy(HELLO, home.tools_dir / "hello.yaml")
    script = tmp_path / "example_async.py"
    script.write_text(readme_asyncio_block(), encoding="utf-8")
    out = subprocess.run([sys.executable, str(script)], env=_env(home), capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[:5] == ["1 pending", "2 routing", "3 executing", "4 formatting", "5 done"], out.stdout
    assert lines[5:] == ["Hello, Alice!", "['Hello, Bob!', 'Hello, Carol!']"], out.stdout
    assert not list((home.path / "run").glob("*.json")) if (home.path / "run").is_dir() else True


def test_the_readmes_asyncio_block_runs_as_printed_against_a_url_with_a_worker(
    redis_url: str, home: Any, gateway: Any, workers: Any, tmp_path: Path
) -> None:
    block = readme_asyncio_block()
    shutil.copy(HELLO, home.tools_dir / "hello.yaml")
    gateway.sync_tools()
    workers(1)
    script = tmp_path / "example_async.py"
    script.write_text(block, encoding="utf-8")
    out = subprocess.run([sys.executable, str(script)], env=_env(home, HERMES_REDIS_URL=redis_url),
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[:5] == ["1 pending", "2 routing", "3 executing", "4 formatting", "5 done"], out.stdout
    assert lines[5:] == ["Hello, Alice!", "['Hello, Bob!', 'Hello, Carol!']"], out.stdout


def test_connect_with_a_url_refuses_a_call_at_once_when_no_worker_listens(redis_url: str, home: Any) -> None:
    from hermes_gateway import Gateway

    shutil.copy(HELLO, home.tools_dir / "hello.yaml")
    with Gateway.connect(redis_url) as gw:
        gw.sync_tools()
        started = time.monotonic()
        with pytest.raises(NoWorkers) as refused:
            gw.call_tool("hello", {"name": "Alice"})
        assert "no worker listens on queue 'tools'" in str(refused.value)
        with pytest.raises(NoWorkers):
            gw.map("hello", [{"name": "Bob"}, {"name": "Carol"}])
        assert time.monotonic() - started < 5
        assert not gw.router.handles  # nothing left waiting
        assert not gw.conn.keys(keys.job("*"))  # and nothing was submitted


def test_async_connect_with_a_url_refuses_a_call_at_once_when_no_worker_listens(redis_url: str, home: Any) -> None:
    from hermes_gateway import AsyncGateway

    shutil.copy(HELLO, home.tools_dir / "hello.yaml")

    async def main() -> None:
        async with await AsyncGateway.connect(redis_url) as gw:
            await gw.sync_tools()
            started = time.monotonic()
            with pytest.raises(NoWorkers) as refused:
                await gw.call_tool("hello", {"name": "Alice"})
            assert "no worker listens on queue 'tools'" in str(refused.value)
            with pytest.raises(NoWorkers):
                await gw.map("hello", [{"name": "Bob"}, {"name": "Carol"}])
            assert time.monotonic() - started < 5
            assert not gw.router.handles  # nothing left waiting
            assert not await gw.conn.keys(keys.job("*"))  # and nothing was submitted

    asyncio.run(main())


def test_connect_attaches_to_the_serve_of_the_same_home(home: Any, tmp_path: Path) -> None:
    from hermes_gateway import AsyncGateway, Gateway

    async def attach_async(pid: int) -> None:  # the asyncio client finds it by the same function
        async with await AsyncGateway.connect() as agw:
            assert agw.broker is not None and agw.broker.embedded is None
            assert f"serve (pid {pid})" in agw.broker.description
            handle = await agw.call_tool("hello", {"name": "Bob"})
            assert await handle.result(timeout=30) == "Hello, Bob!"
            with pytest.raises(NoWorkers, match="'other'"):
                await agw.call_tool("elsewhere", {})

    shutil.copy(HELLO, home.tools_dir / "hello.yaml")
    env = _env(home)
    port = free_port()
    with open(tmp_path / "serve.log", "w+") as log:
        serve = subprocess.Popen([CLI, "serve", "--port", str(port)], env=env, stdout=log, stderr=log)
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz", serve, timeout=60)
            with Gateway.connect() as gw:
                assert gw.broker.embedded is None  # not a broker of its own ...
                assert f"serve (pid {serve.pid})" in gw.description  # ... but serve's
                gw.sync_tools()
                assert gw.call_tool("hello", {"name": "Alice"}).result(timeout=30) == "Hello, Alice!"
                # No worker of serve listens on another queue: a call to it is refused at once, naming it.
                gw.register_tool({"name": "elsewhere", "executor": "python", "queue": "other",
                                  "function": "workers.executors.builtin:echo"})  # fmt: skip
                with pytest.raises(NoWorkers, match="'other'"):
                    gw.call_tool("elsewhere", {})
            asyncio.run(attach_async(serve.pid))
        finally:
            subprocess.run([CLI, "stop", "--all"], env=env, capture_output=True, timeout=60)
            if serve.poll() is None:
                serve.kill()
            serve.wait(30)
            log.seek(0)
            print(log.read())
