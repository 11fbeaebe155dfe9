"""Every executor through real worker processes: a success and a typed failure each, back through the queue."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from broker.audit import AuditLog
from broker.errors import CallFailed, ExecutorError, InvalidArgs
from tests.conftest import wait_until
from tests.workers.executors.http_server import Recorder
from tests.workers.executors.test_grpc import SERVICE
from tests.workers.executors.test_grpc import address as grpc_address  # noqa: F401 - a fixture

PY = sys.executable
MCP_SERVER = str(Path(__file__).resolve().parents[1] / "workers" / "executors" / "mcp_server.py")
PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
SEED_BODY_TEMPLATE = "body_template: {query: {{city}}, opts: {unit: {{unit}}}}"


def _status_code(gateway: Any, handle: Any) -> Any:
    """The call's audit record's ``status_code`` (the back end's: HTTP status, exit code, gRPC status)."""
    log = AuditLog(gateway.conn)
    return wait_until(lambda: log.get(handle.call_id), 10, message="the audit record").status_code


def _failure(handle: Any, error: type[Exception]) -> Any:
    with pytest.raises(error) as info:
        handle.result(20)
    return info.value


def test_command_hello_and_a_failing_program(gateway: Any, home: Any, workers: Any) -> None:
    # The seed's hello.yaml, as the user writes it.
    (home.tools_dir / "hello.yaml").write_text(
        "name: hello\ndescription: 对输入的人名问好返回问候语\nexecutor: command\ncommand: echo Hello, {{name}}!\n"
        "input_schema:\n  type: object\n  properties:\n    name:\n      type: string\n",
        encoding="utf-8",
    )
    home.tool("exit3", "command", command=[PY, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])
    workers(1)
    gateway.sync_tools()
    hello = gateway.call_tool("hello", {"name": "Alice"})
    assert hello.result(20) == "Hello, Alice!"
    exit3 = gateway.call_tool("exit3", max_attempts=1)
    err = _failure(exit3, ExecutorError)
    assert "boom" in str(err)
    assert (_status_code(gateway, hello), _status_code(gateway, exit3)) == (0, 3)  # the exit codes, audited
    err = _failure(gateway.call_tool("hello", {"name": 42}), InvalidArgs)  # schema, judged on the worker
    assert "name" in str(err)


def test_python_function_and_its_exception(gateway: Any, home: Any, workers: Any) -> None:
    home.tool("add", function="tests.workers.executors.pyfuncs:add")
    home.tool("explode", function="tests.workers.executors.pyfuncs:explode")
    workers(1)
    gateway.sync_tools()
    assert gateway.call_tool("add", {"a": 2, "b": 40}).result(20) == 42
    err = _failure(gateway.call_tool("explode", {"message": "kaboom"}, max_attempts=1), ExecutorError)
    assert "kaboom" in str(err)


@pytest.fixture
def http_server() -> Iterator[Recorder]:
    server = Recorder()
    yield server
    server.close()


def test_http_with_the_seeds_body_template_and_an_error_status(
    gateway: Any, home: Any, workers: Any, http_server: Recorder
) -> None:
    home.config({"executors": {"http": {"allow_networks": ["127.0.0.1/32"]}}})
    (home.tools_dir / "search_weather.yaml").write_text(
        f"name: search_weather\nexecutor: http\nmethod: POST\nendpoint: {http_server.base}/search\n"
        f"{SEED_BODY_TEMPLATE}\n",
        encoding="utf-8",
    )
    home.tool("missing_page", "http", endpoint=f"{http_server.base}/status/404")
    workers(1)
    gateway.sync_tools()
    found = gateway.call_tool("search_weather", {"city": "北京", "unit": "celsius"})
    result = found.result(20)
    assert result["method"] == "POST" and result["raw_path"] == "/search"
    assert json.loads(result["body"]) == {"query": "北京", "opts": {"unit": "celsius"}}
    missing = gateway.call_tool("missing_page", {"msg": "gone"}, max_attempts=1)
    err = _failure(missing, ExecutorError)
    assert err.details.get("status") == 404 and "backend says no: gone" in str(err)
    assert (_status_code(gateway, found), _status_code(gateway, missing)) == (200, 404)


@pytest.fixture
def tables(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A weather table in a SQLite file and in the real PostgreSQL (dsn -> table name)."""
    table = f"weather_{uuid.uuid4().hex[:8]}"
    dsns = {f"sqlite:///{tmp_path / 'weather.sqlite'}": table, PG_DSN: table}
    engines = []
    for dsn in dsns:
        engine = sa.create_engine(dsn.replace("postgresql://", "postgresql+psycopg://"))
        engines.append(engine)
        with engine.begin() as c:
            c.exec_driver_sql(f"CREATE TABLE {table} (city TEXT, temp INTEGER)")
            c.exec_driver_sql(f"INSERT INTO {table} VALUES ('北京', 21), ('上海', 25)")
    yield dsns
    for engine in engines:
        with engine.begin() as c:
            c.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        engine.dispose()


def test_database_on_sqlite_and_postgresql(
    gateway: Any, home: Any, workers: Any, tables: dict[str, str]
) -> None:
    for i, (dsn, table) in enumerate(tables.items()):
        home.tool(
            f"temps{i}", "database", dsn=dsn, query=f"SELECT city, temp FROM {table} WHERE city = :city"
        )
        home.tool(f"broken{i}", "database", dsn=dsn, query=f"SELECT nope FROM {table}")
        home.tool(f"writes{i}", "database", dsn=dsn, query=f"DELETE FROM {table}")
    workers(1)
    gateway.sync_tools()
    for i in range(len(tables)):
        assert gateway.call_tool(f"temps{i}", {"city": "北京"}).result(20) == [{"city": "北京", "temp": 21}]
        err = _failure(gateway.call_tool(f"broken{i}", max_attempts=1), ExecutorError)
        assert "nope" in str(err)
        # Read-only by default: a write statement is refused before it reaches the database.
        err = _failure(gateway.call_tool(f"writes{i}", max_attempts=1), CallFailed)
        assert err.error_type == "invalid_spec" and "read-only" in str(err)
    for dsn, table in tables.items():  # nothing was deleted
        engine = sa.create_engine(dsn.replace("postgresql://", "postgresql+psycopg://"))
        with engine.connect() as c:
            assert c.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar() == 2
        engine.dispose()


def test_grpc_unary_call_and_a_status_code(gateway: Any, home: Any, workers: Any, grpc_address: str) -> None:  # noqa: F811
    home.tool("greet", "grpc", target=grpc_address, method=f"{SERVICE}/Greet", metadata={"x-tenant": "acme"})
    home.tool("refuse", "grpc", target=grpc_address, method=f"{SERVICE}/Fail")
    workers(1)
    gateway.sync_tools()
    greeted = gateway.call_tool("greet", {"name": "北京"})
    result = greeted.result(20)
    assert result["message"] == "Hello, 北京!" and result["tags"][1] == "acme"
    assert result["tags"][0].startswith("00-")  # the call's traceparent reached the server
    refused = gateway.call_tool("refuse", {"name": "INVALID_ARGUMENT"}, max_attempts=1)
    err = _failure(refused, InvalidArgs)
    assert "backend refused: INVALID_ARGUMENT" in str(err)
    assert (_status_code(gateway, greeted), _status_code(gateway, refused)) == ("OK", "INVALID_ARGUMENT")


def test_grpc_server_stream_reports_progress_as_events_then_the_messages(
    gateway: Any, home: Any, workers: Any, grpc_address: str  # noqa: F811
) -> None:
    home.tool("count", "grpc", target=grpc_address, method=f"{SERVICE}/Count")
    workers(1)
    gateway.sync_tools()
    handle = gateway.call_tool("count", {"times": 3, "name": "0.15"})
    assert [m["message"] for m in handle.result(20)] == ["1", "2", "3"]
    progress = [e.detail["message"].split(",")[0] for e in handle.events() if e.type == "progress"]
    # Messages 0.15 s apart, progress at most every 0.1 s (STREAM_PROGRESS_EVERY): on a loaded machine two
    # messages can come closer than that, and the second is then told with the next one.
    assert progress[-1] == "gRPC stream ended: 3 message(s)"
    counts = [int(p.removeprefix("gRPC stream: ").split()[0]) for p in progress[:-1]]
    assert counts[0] == 1 and counts == sorted(set(counts)) and counts[-1] <= 3, progress


def test_mcp_stdio_tool_and_an_is_error_result(gateway: Any, home: Any, workers: Any) -> None:
    server = {"command": [PY, MCP_SERVER, "stdio"], "stderr": "discard"}
    home.tool("mcp_greet", "mcp", mcp=server, tool="greet")
    home.tool("mcp_fail", "mcp", mcp=server, tool="fail")
    workers(1)
    gateway.sync_tools()
    assert gateway.call_tool("mcp_greet", {"name": "Alice"}).result(30) == "Hello, Alice!"
    err = _failure(
        gateway.call_tool("mcp_fail", {"message": "server says no"}, max_attempts=1), ExecutorError
    )
    assert "server says no" in str(err)
