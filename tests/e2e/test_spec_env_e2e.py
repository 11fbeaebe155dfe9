"""Review 17 (D1, D8, D12) through real worker processes, a real Redis and real back ends.

D1: ``${VAR}`` in a spec is filled by the WORKER from its own environment; Redis, events, the audit log
and the worker's log never hold the value, an argument value that looks like a reference stays literal,
and an unset variable is a typed failure naming the key and the variable.
D8: a spec that could never run is refused at registration (Python API, the HTTP API).
D12: the seed's body template with the optional ``unit`` left out.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from broker.audit import AuditLog
from broker.errors import CallFailed, InvalidSpec
from tests.conftest import wait_until
from tests.e2e.test_http_api import Served
from tests.workers.executors.http_server import Recorder

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tools"
PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
TOKEN = f"tok-worker-{uuid.uuid4().hex}"
# The shipped examples declare permissions: [read_only].
READERS = {"principals": {"*": {"grants": ["read_only"]}}}


@pytest.fixture
def http_server() -> Iterator[Recorder]:
    server = Recorder()
    yield server
    server.close()


def dump_db(conn: Any) -> bytes:
    """Every value of every key in the (per-test) database, as bytes."""
    out = bytearray()
    for key in conn.scan_iter(count=1000):
        kind = conn.type(key).decode()
        out += key
        if kind == "string":
            out += conn.get(key) or b""
        elif kind == "hash":
            for k, v in conn.hgetall(key).items():
                out += k + v
        elif kind == "list":
            out += b"".join(conn.lrange(key, 0, -1))
        elif kind == "set":
            out += b"".join(conn.smembers(key))
        elif kind == "zset":
            out += b"".join(conn.zrange(key, 0, -1))
        elif kind == "stream":
            for _, fields in conn.xrange(key):
                for k, v in fields.items():
                    out += k + v
    return bytes(out)


def search_weather_json(home: Any, base: str) -> None:
    """The shipped example, pointed at the test server (a path that does not echo the request back)."""
    text = (EXAMPLES / "search_weather_json.yaml").read_text(encoding="utf-8")
    text = text.replace("http://127.0.0.1:8081/weather/search", f"{base}/text")
    assert "Bearer ${WEATHER_API_TOKEN}" in text
    (home.tools_dir / "search_weather_json.yaml").write_text(text, encoding="utf-8")


def test_the_worker_sends_the_bearer_token_from_its_environment_and_publishes_it_nowhere(
    gateway: Any, home: Any, workers: Any, http_server: Recorder, conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WEATHER_API_TOKEN", raising=False)  # the client has no such variable
    home.config({"executors": {"http": {"allow_networks": ["127.0.0.1/32"]}}, "policy": READERS})
    search_weather_json(home, http_server.base)
    [worker] = workers(1, env={"WEATHER_API_TOKEN": TOKEN})
    gateway.sync_tools()

    handle = gateway.call_tool("search_weather_json", {"city": "北京", "unit": "celsius"})
    assert handle.result(20) == "plain 北京\n"
    request = http_server.requests[-1]
    assert request["headers"]["authorization"] == f"Bearer {TOKEN}"
    assert json.loads(request["body"]) == {"query": "北京", "opts": {"unit": "celsius"}}

    # Hostile: a caller sends a reference as a value; it reaches the back end as the same text.
    hostile = gateway.call_tool(
        "search_weather_json", {"city": "${WEATHER_API_TOKEN} ${HOME}", "unit": "celsius"}
    )
    hostile.result(20)
    assert json.loads(http_server.requests[-1]["body"])["query"] == "${WEATHER_API_TOKEN} ${HOME}"

    # The directory keeps the reference (`tool show` shows it), and nothing in Redis holds the value:
    # not the directory, job hashes, event histories, the audit stream.
    stored = gateway.directory.fetch("search_weather_json").spec.to_dict()
    assert stored["headers"]["Authorization"] == "Bearer ${WEATHER_API_TOKEN}"
    log = AuditLog(gateway.conn)
    wait_until(lambda: log.get(hostile.call_id), 10, message="the audit record")
    assert TOKEN.encode() not in dump_db(conn)
    assert TOKEN not in worker.log()


def test_a_database_dsn_from_the_workers_environment_on_sqlite_and_postgresql(
    gateway: Any, home: Any, workers: Any, tmp_path: Path, conn: Any
) -> None:
    table = f"weather_{uuid.uuid4().hex[:8]}"
    sqlite_dsn = f"sqlite:///{tmp_path / 'weather.sqlite'}"
    engines = [
        sa.create_engine(sqlite_dsn),
        sa.create_engine(PG_DSN.replace("postgresql://", "postgresql+psycopg://")),
    ]
    for engine in engines:
        with engine.begin() as c:
            c.exec_driver_sql(f"CREATE TABLE {table} (city TEXT, temp INTEGER)")
            c.exec_driver_sql(f"INSERT INTO {table} VALUES ('北京', 21), ('上海', 25)")
    try:
        for name, var in (("temps_sqlite", "E2E_SQLITE_DSN"), ("temps_pg", "E2E_PG_DSN")):
            home.tool(
                name,
                "database",
                dsn=f"${{{var}}}",
                query=f"SELECT city, temp FROM {table} WHERE city = :city",
                input_schema={
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            )
        workers(1, env={"E2E_SQLITE_DSN": sqlite_dsn, "E2E_PG_DSN": PG_DSN})
        gateway.sync_tools()
        for name in ("temps_sqlite", "temps_pg"):
            assert gateway.call_tool(name, {"city": "北京"}).result(20) == [{"city": "北京", "temp": 21}]
        assert gateway.directory.fetch("temps_pg").spec.config["dsn"] == "${E2E_PG_DSN}"
        assert sqlite_dsn.encode() not in dump_db(conn)
    finally:
        for engine in engines:
            with engine.begin() as c:
                c.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
            engine.dispose()


def test_the_shipped_database_example_names_the_unset_variable(
    gateway: Any, home: Any, workers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WEATHER_DB_DSN", raising=False)  # so the worker (started from here) lacks it too
    home.config({"policy": READERS})
    (home.tools_dir / "city_weather_history.yaml").write_text(
        (EXAMPLES / "city_weather_history.yaml").read_text(encoding="utf-8"), encoding="utf-8"
    )
    workers(1)
    gateway.sync_tools()
    with pytest.raises(CallFailed) as info:
        gateway.call_tool("city_weather_history", {"city": "北京"}, max_attempts=1).result(20)
    assert info.value.error_type == "invalid_spec"
    assert str(info.value) == (
        "tool 'city_weather_history': dsn: ${WEATHER_DB_DSN} is not set in the worker's environment"
    )


def test_the_seeds_body_template_with_the_optional_unit_left_out(
    gateway: Any, home: Any, workers: Any, http_server: Recorder
) -> None:
    home.config({"executors": {"http": {"allow_networks": ["127.0.0.1/32"]}}})
    (home.tools_dir / "get_weather.yaml").write_text(
        "name: get_weather\ndescription: 查询城市天气\nexecutor: http\nmethod: POST\n"
        f"endpoint: {http_server.base}/weather\n"
        "body_template: {query: {{city}}, opts: {unit: {{unit}}}}\n"
        "input_schema:\n  type: object\n  properties:\n    city: {type: string}\n"
        "    unit: {type: string, enum: [celsius, fahrenheit]}\n  required: [city]\n",
        encoding="utf-8",
    )
    workers(1)
    gateway.sync_tools()
    result = gateway.call_tool("get_weather", {"city": "北京"}).result(20)
    assert json.loads(result["body"]) == {"query": "北京", "opts": {}}
    with pytest.raises(CallFailed) as info:
        gateway.call_tool("get_weather", {"unit": "celsius"}, max_attempts=1).result(20)
    assert info.value.error_type == "invalid_args"  # city is required: the schema says so, on the worker


@pytest.mark.parametrize(
    ("spec", "path"),
    [
        ({"name": "x", "executor": "http", "description": "d", "endpoint": "not a url"}, "endpoint"),
        (
            {"name": "x", "executor": "http", "description": "d", "endpoint": "ftp://example.com/x"},
            "endpoint",
        ),
        ({"name": "pyx", "executor": "python", "description": "d", "function": "nocolon"}, "function"),
        (
            {
                "name": "hello",
                "executor": "command",
                "command": "echo {{zz}}",
                "input_schema": {"type": "object", "properties": {"name": {"type": "string"}}},
            },
            "command",
        ),
    ],
)
def test_specs_that_could_never_run_are_refused_by_the_python_and_http_apis(
    gateway: Any, spec: dict[str, Any], path: str
) -> None:
    with pytest.raises(InvalidSpec) as info:
        gateway.register_tool(spec)
    assert info.value.details["path"] == path
    served = Served(gateway)
    try:
        with httpx.Client(base_url=served.base, timeout=10) as client:
            response = client.post("/v1/tools", json=spec)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_spec" and f"{path}: " in error["message"]
            assert client.get(f"/v1/tools/{spec['name']}").status_code == 404
    finally:
        served.stop()


def test_a_spec_file_that_could_never_run_is_reported_by_sync_and_not_registered(
    gateway: Any, home: Any
) -> None:
    (home.tools_dir / "s6.yaml").write_text("name: x\nexecutor: http\ndescription: d\nendpoint: not a url\n")
    errors: list[InvalidSpec] = []
    gateway.sync_tools(errors=errors)
    assert [e.details.get("path") for e in errors] == ["endpoint"]
    assert "s6.yaml" in str(errors[0]) and "expected an http(s) URL" in str(errors[0])
    assert gateway.directory.fetch("x") is None
