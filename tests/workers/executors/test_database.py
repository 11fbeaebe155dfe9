"""The database executor on SQLite and the real PostgreSQL: bound parameters, read-only, caps, timeouts."""

from __future__ import annotations

import re
import threading
import time
import uuid

import pytest
import sqlalchemy as sa

from broker.errors import CallCancelled, ExecutorError, InvalidArgs, InvalidSpec, ToolTimeout
from broker.toolspec import ToolSpec
from workers.executors import database
from workers.specs import check_spec

PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"

INJECTIONS = [
    "' OR '1'='1",
    "' OR 1=1 --",
    "'; DROP TABLE {secret}; --",
    "北京'; DELETE FROM {weather}; --",
    "' UNION SELECT secret, 0 FROM {secret} --",
    "1 OR 1=1",
    "'||(SELECT secret FROM {secret} LIMIT 1)||'",
    "\\'; DROP TABLE {weather}; --",
    "%' OR '%'='",
    "' AND SLEEP(5) --",
    "'; SELECT pg_sleep(5); --",
    "1; UPDATE {weather} SET temp = 999",
    "' OR city IS NOT NULL --",
    "admin'--",
    "') OR ('1'='1",
    '" OR ""="',
    "' ; INSERT INTO {secret} VALUES ('pwned') ; --",
    "'/**/OR/**/1=1/**/--",
    "\x00' OR 1=1",
    "' OR 'x' LIKE '%",
    "北京' --",
    "$$; DROP TABLE {weather}; $$",
    "'; COPY {secret} TO '/tmp/pwned'; --",
    "'; ATTACH DATABASE '/tmp/pwned.db' AS p; --",
    ":city",
    "?",
    "%s",
    "'; PRAGMA query_only = OFF; DELETE FROM {weather}; --",
    "' OR ''='",
    "0x27204f5220313d31",
    "'; CREATE TABLE pwned(x int); --",
    "\\",
]


def _setup(engine: sa.Engine, weather: str, secret: str) -> None:
    with engine.begin() as c:
        c.exec_driver_sql(f"CREATE TABLE {weather} (city TEXT, temp NUMERIC, day DATE)")
        c.exec_driver_sql(
            f"INSERT INTO {weather} VALUES ('北京', 21.5, '2024-05-01'), ('上海', 25, '2024-05-01'), "
            f"('北京', 19, '2024-05-02')"
        )
        c.exec_driver_sql(f"CREATE TABLE {secret} (secret TEXT)")
        c.exec_driver_sql(f"INSERT INTO {secret} VALUES ('hunter2')")


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    """(dsn, weather table, secret table) on a fresh SQLite file and on the real PostgreSQL."""
    suffix = uuid.uuid4().hex[:8]
    weather, secret = f"weather_{suffix}", f"secret_{suffix}"
    dsn = f"sqlite:///{tmp_path / 'db.sqlite'}" if request.param == "sqlite" else PG_DSN
    engine = sa.create_engine(dsn.replace("postgresql://", "postgresql+psycopg://"))
    _setup(engine, weather, secret)
    yield dsn, weather, secret, engine
    with engine.begin() as c:
        c.exec_driver_sql(f"DROP TABLE IF EXISTS {weather}")
        c.exec_driver_sql(f"DROP TABLE IF EXISTS {secret}")
    engine.dispose()


@pytest.fixture
def ex():
    executor = database.DatabaseExecutor({})
    yield executor
    executor.close()


def spec(**config) -> ToolSpec:
    return check_spec({"name": "t", "executor": "database", **config})


def test_template_query_binds_parameters_and_reports_progress(ex, db, make_ctx):
    dsn, weather, _, _ = db
    ctx = make_ctx()
    s = spec(dsn=dsn, query=f"SELECT city, temp, day FROM {weather} WHERE city = :city ORDER BY day")
    rows = ex.run(s, {"city": "北京"}, ctx)
    assert rows == [
        {"city": "北京", "temp": 21.5, "day": "2024-05-01"},
        {"city": "北京", "temp": 19, "day": "2024-05-02"},
    ]
    assert ctx.messages == ["querying database", "2 rows found, formatting"]


def test_missing_bind_value_is_invalid_args(ex, db, make_ctx):
    dsn, weather, _, _ = db
    with pytest.raises(InvalidArgs, match=":city"):
        ex.run(spec(dsn=dsn, query=f"SELECT * FROM {weather} WHERE city = :city"), {}, make_ctx())


def test_write_statements_are_refused_in_read_only_mode(ex, db, make_ctx):
    dsn, weather, _, _ = db
    for query in (f"DELETE FROM {weather}", f"SELECT 1; DELETE FROM {weather}", f"DROP TABLE {weather}"):
        with pytest.raises(InvalidSpec):
            ex.run(spec(dsn=dsn, query=query), {}, make_ctx())


def test_read_only_transaction_blocks_writes_hidden_in_a_select(ex, db, make_ctx):
    dsn, weather, _, engine = db
    if dsn.startswith("sqlite"):
        query = f"WITH x AS (SELECT 1) INSERT INTO {weather}(city) SELECT 'pwned' FROM x"
    else:
        query = f"WITH d AS (DELETE FROM {weather} RETURNING city) SELECT city FROM d"
    with pytest.raises(ExecutorError):
        ex.run(spec(dsn=dsn, query=query), {}, make_ctx())
    with engine.connect() as c:
        assert c.exec_driver_sql(f"SELECT count(*) FROM {weather}").scalar() == 3


def test_writes_commit_when_read_only_is_false(ex, db, make_ctx):
    dsn, weather, _, engine = db
    s = spec(dsn=dsn, read_only=False, query=f"INSERT INTO {weather}(city, temp) VALUES (:city, :temp)")
    assert ex.run(s, {"city": "广州", "temp": 30}, make_ctx()) == []
    with engine.connect() as c:
        assert c.exec_driver_sql(f"SELECT count(*) FROM {weather}").scalar() == 4


def test_row_cap_truncates_and_says_so(ex, db, make_ctx):
    dsn, weather, _, _ = db
    ctx = make_ctx()
    rows = ex.run(spec(dsn=dsn, max_rows=2, query=f"SELECT city FROM {weather}"), {}, ctx)
    assert len(rows) == 2 and "only the first 2" in ctx.messages[-1]


def test_database_error_is_executor_error_with_message(ex, db, make_ctx):
    dsn, _, _, _ = db
    with pytest.raises(ExecutorError, match="no_such_table"):
        ex.run(spec(dsn=dsn, query="SELECT * FROM no_such_table"), {}, make_ctx())


SLOW = {
    "sqlite": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c",
    "postgresql": "SELECT pg_sleep(20)",
}


def test_slow_query_times_out(ex, db, make_ctx):
    dsn = db[0]
    with pytest.raises(ToolTimeout):
        ex.run(spec(dsn=dsn, query=SLOW[dsn.split(":")[0]]), {}, make_ctx(timeout=0.5))


def test_slow_query_is_cancelled(ex, db, make_ctx):
    dsn = db[0]
    ctx = make_ctx(timeout=30)
    threading.Timer(0.3, ctx.cancelled.set).start()
    with pytest.raises(CallCancelled):
        ex.run(spec(dsn=dsn, query=SLOW[dsn.split(":")[0]]), {}, ctx)


def test_sql_injection_corpus_returns_nothing_and_changes_nothing(ex, db, make_ctx):
    dsn, weather, secret, engine = db
    assert len(INJECTIONS) >= 30
    s = spec(dsn=dsn, query=f"SELECT city, temp FROM {weather} WHERE city = :city")
    for raw in INJECTIONS:
        value = raw.format(weather=weather, secret=secret)
        try:
            rows = ex.run(s, {"city": value}, make_ctx())
        except ExecutorError as e:  # PostgreSQL refuses NUL bytes in text; that is a refusal, not an escape
            assert "\x00" in value, (value, e)
            continue
        assert rows == [], value
    with engine.connect() as c:
        assert c.exec_driver_sql(f"SELECT count(*) FROM {weather}").scalar() == 3
        assert c.exec_driver_sql(f"SELECT secret FROM {secret}").scalars().all() == ["hunter2"]
        names = set(sa.inspect(c).get_table_names())
    assert "pwned" not in names and {weather, secret} <= names


def structured(dsn: str, weather: str) -> ToolSpec:
    return spec(dsn=dsn, mode="structured", tables={weather: ["city", "temp"]})


def test_structured_mode_builds_a_bound_select(ex, db, make_ctx):
    dsn, weather, _, _ = db
    rows = ex.run(
        structured(dsn, weather),
        {"table": weather, "columns": ["temp"], "where": {"city": ["上海"]}},
        make_ctx(),
    )
    assert rows == [{"temp": 25}]
    rows = ex.run(
        structured(dsn, weather), {"table": weather, "where": {"city": "北京"}, "limit": 1}, make_ctx()
    )
    assert len(rows) == 1 and set(rows[0]) == {"city", "temp"}


def test_structured_mode_refuses_names_outside_the_allow_list(ex, db, make_ctx):
    dsn, weather, secret, engine = db
    s = structured(dsn, weather)
    hostile = [
        {"table": secret},
        {"table": f"{weather}; DROP TABLE {secret}"},
        {"table": weather, "columns": ["day"]},
        {"table": weather, "columns": ["city, (SELECT secret FROM " + secret + ")"]},
        {"table": weather, "columns": ["*"]},
        {"table": weather, "where": {"1=1 OR city": "x"}},
        {"table": weather, "where": {"day": "2024-05-01"}},
        {"table": weather, "limit": "1; DROP TABLE x"},
        {"table": weather, "limit": -1},
        {"table": weather, "where": "city = 'x' OR 1=1"},
    ]
    for args in hostile:
        with pytest.raises(InvalidArgs):
            ex.run(s, args, make_ctx())
    for raw in INJECTIONS:
        if "\x00" in raw:
            continue
        assert (
            ex.run(
                s,
                {"table": weather, "where": {"city": raw.format(weather=weather, secret=secret)}},
                make_ctx(),
            )
            == []
        )
    with engine.connect() as c:
        assert c.exec_driver_sql(f"SELECT count(*) FROM {secret}").scalar() == 1


def test_missing_dsn_is_spec_error(ex, make_ctx):
    with pytest.raises(InvalidSpec, match="dsn"):
        ex.run(spec(query="SELECT 1"), {}, make_ctx())


def test_dsn_from_executor_settings(tmp_path, make_ctx):
    executor = database.DatabaseExecutor({"dsn": f"sqlite:///{tmp_path / 'x.db'}"})
    try:
        assert executor.run(spec(query="SELECT 1 AS one, :v AS v"), {"v": "a"}, make_ctx()) == [
            {"one": 1, "v": "a"}
        ]
    finally:
        executor.close()


def test_a_server_that_takes_the_connection_and_never_answers_is_held_to_the_timeout(ex, make_ctx):
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # (accepted by the kernel, never answered)
    port = silent.getsockname()[1]
    try:
        started = time.monotonic()
        with pytest.raises(ToolTimeout):
            ex.run(spec(dsn=f"postgresql://postgres@127.0.0.1:{port}/test", query="SELECT 1"), {}, make_ctx(timeout=1))
        assert time.monotonic() - started < 6  # libpq's least connect timeout is 2 s (it waited 130 s)
    finally:
        silent.close()


def test_max_rows_bounds_the_memory_a_huge_result_takes_not_only_what_comes_back(ex, make_ctx):
    import psutil

    me = psutil.Process()
    base, peak, done = me.memory_info().rss, [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], me.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    query = "SELECT g, repeat('x', 100) AS pad FROM generate_series(1, 3000000) g"
    try:
        rows = ex.run(spec(dsn=PG_DSN, query=query, max_rows=10), {}, make_ctx(timeout=60))
    finally:
        done.set()
        sampler.join()
    assert [r["g"] for r in rows] == list(range(1, 11))
    assert peak[0] - base < 150 * 1024 * 1024, (peak[0] - base) // 2**20  # (all 3,000,000 rows: ~500 MB)


def test_numerics_a_caller_chooses_come_back_as_numbers_or_their_digits_not_a_crash(ex, make_ctx):
    import math

    s = spec(dsn=PG_DSN, query="SELECT CAST(:x AS numeric) AS v")
    rows = {x: ex.run(s, {"x": x}, make_ctx())[0]["v"] for x in ("Infinity", "-Infinity", "NaN", "1e400", "12", "2.5")}
    assert rows["Infinity"] == math.inf and rows["-Infinity"] == -math.inf and math.isnan(rows["NaN"])
    assert rows["1e400"] == str(10**400)  # (past a float: its digits, not inf)
    assert (rows["12"], rows["2.5"]) == (12, 2.5)
    assert ex.run(s, {"x": str(2**70)}, make_ctx())[0]["v"] == float(2**70)  # (past 64 bits: msgpack's limit)


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("SELECT :x::numeric AS v", "write CAST(:x AS type)"),
        ("SELECT * FROM t WHERE id = {{id}}", "not {{name}} or %(name)s"),
        ("SELECT * FROM t WHERE id = %(id)s", "not {{name}} or %(name)s"),
    ],
)
def test_a_placeholder_that_would_never_bind_is_refused_at_registration(query, says):
    with pytest.raises(InvalidSpec, match=re.escape(says)):
        spec(dsn="sqlite://", query=query)
    spec(dsn="sqlite://", query="SELECT '{{not a placeholder}}' AS lit, CAST(:x AS numeric) AS v")  # (fine)


@pytest.mark.parametrize("tables", [{}, {"weather": None}, {"weather": []}, {"weather": ["city", ""]}])
def test_structured_mode_needs_tables_with_columns_at_registration(tables: dict) -> None:
    # (a table with no column was accepted, and every call failed in the database on `SELECT LIMIT n`)
    with pytest.raises(InvalidSpec, match="tables"):
        spec(dsn="sqlite://", mode="structured", tables=tables)
