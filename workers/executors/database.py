"""The ``database`` executor: parameterised SQL through SQLAlchemy 2, read-only by default.

Template mode binds the arguments to ``:name`` parameters of one ``query`` (an optional field left out
binds NULL); structured mode builds a SELECT from ``{table, columns, where, limit}`` checked against the
``tables`` allow-list. ``read_only`` statements run in a transaction always rolled back; the deadline
becomes a statement timeout, cancellation cancels the statement, ``max_rows`` caps the result (a list
of row dicts with JSON-friendly values).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import decimal
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from broker.errors import CallCancelled, ExecutorError, HermesError, InvalidArgs, InvalidSpec, ToolTimeout
from broker.placeholders import optional
from broker.toolspec import ToolSpec

from . import POLL, ExecContext, require

if TYPE_CHECKING:  # SQLAlchemy (and its driver) is imported where a query runs, not where a spec registers
    import sqlalchemy as sa
    from sqlalchemy.engine import Connection, Engine

DEFAULT_MAX_ROWS = 1000
_READ_VERBS = {"select", "with", "values", "table", "show", "explain"}
_QUERY_VERBS = _READ_VERBS - {"show", "explain"}  # what a cursor can be declared FOR (streamed results)
_MODES = ("template", "structured")
_SQL_COMMENTS = re.compile(r"(--[^\n]*|/\*.*?\*/)", re.S)


def checked_query(where: str, query: Any) -> str:
    """``query`` when it is one SQL statement (a ``;`` in a string literal is fine)."""
    if not isinstance(query, str) or not query.strip():
        raise InvalidSpec.at(where, "query", "expected an SQL string (or mode: structured)")
    body = _SQL_COMMENTS.sub(" ", query).strip().rstrip(";")
    code = re.sub(r"'(?:[^']|'')*'", "''", body)  # (string literals out)
    if ";" in code:
        raise InvalidSpec.at(where, "query", "one statement only")
    # Placeholders that would never bind (every call would fail with a syntax error): SQLAlchemy binds :name.
    if "{{" in code or "%(" in code:
        raise InvalidSpec.at(where, "query", "parameters are written :name (the value is bound, never pasted "
                                             "into the SQL), not {{name}} or %(name)s")
    if cast := re.search(r"(?<![:\w]):(\w+)::", code):
        raise InvalidSpec.at(where, "query", f":{cast.group(1)}::type does not bind (SQLAlchemy reads :{cast.group(1)}: "
                                             f"as text); write CAST(:{cast.group(1)} AS type)")
    return query


def first_keyword(sql: str) -> str:
    """The statement's first keyword, lower case (comments and an opening parenthesis skipped)."""
    stripped = _SQL_COMMENTS.sub(" ", sql).strip().lstrip("(").strip()
    return stripped.split(None, 1)[0].lower() if stripped else ""


_connecting: contextvars.ContextVar[ExecContext | None] = contextvars.ContextVar("connecting", default=None)


def _connect_within_the_call(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
    # A server that takes the connection and never answers held the call for libpq's default (130 s here),
    # past its timeout and its cancel: the connect gets what is left of the call (libpq's least is 2 s).
    if (ctx := _connecting.get()) is not None:
        cparams["connect_timeout"] = max(2, math.ceil(ctx.deadline - time.monotonic()))


class DatabaseExecutor:
    """Engines are cached per DSN and shared by all worker threads (SQLAlchemy pools are thread-safe)."""

    keys = frozenset({"dsn", "query", "mode", "tables", "read_only", "max_rows", "max_output"})

    @staticmethod
    def check(where: str, data: Mapping[str, Any]) -> None:
        mode = data.get("mode")
        if mode == "structured":
            require(where, "database", data, ("tables",), "with mode: structured, the allow-list {table: [columns]}")
        else:
            require(where, "database", data, ("query",), "the SQL with :named parameters (or `mode: structured` with `tables`)")
        dsn = data.get("dsn")
        if dsn is not None and not isinstance(dsn, str):
            raise InvalidSpec.at(where, "dsn", f"expected a database URL, got {type(dsn).__name__}")
        if mode is not None and mode not in _MODES:
            raise InvalidSpec.at(where, "mode", f"expected one of {', '.join(_MODES)}, got {mode!r}")
        if mode == "structured":
            tables = data["tables"]
            if not isinstance(tables, dict):
                raise InvalidSpec.at(where, "tables", "expected a mapping {table: [allowed columns]}")
            if not tables:
                raise InvalidSpec.at(where, "tables", "expected at least one table {table: [allowed columns]}")
            for table, columns in tables.items():  # (a table with no column would be read as `SELECT LIMIT n`)
                if not (isinstance(columns, list) and columns and all(isinstance(c, str) and c for c in columns)):
                    raise InvalidSpec.at(where, f"tables.{table}", "expected a non-empty list of column names")
            return
        checked_query(where, data["query"])

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self._engines: dict[str, Engine] = {}
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[ExecContext, Callable[[], None]]] = {}
        self._watcher: threading.Thread | None = None

    def engine(self, dsn: str) -> Engine:
        if (found := self._engines.get(dsn)) is not None:
            return found
        with self._lock:
            if (found := self._engines.get(dsn)) is None:
                import sqlalchemy as sa

                url = re.sub(r"^postgres(ql)?://", "postgresql+psycopg://", dsn)
                try:
                    found = sa.create_engine(url, pool_pre_ping=True)
                except (sa.exc.ArgumentError, ImportError) as e:
                    raise InvalidSpec(f"database: dsn: {e}") from e
                if found.dialect.name == "postgresql":
                    sa.event.listen(found, "do_connect", _connect_within_the_call)
                self._engines[dsn] = found
        return found

    def run(self, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext) -> Any:
        import sqlalchemy as sa

        config = {**self.settings, **spec.config}
        where = f"tool {spec.name!r}"
        dsn = config.get("dsn")
        if not isinstance(dsn, str) or not dsn:
            raise InvalidSpec(f"{where}: dsn: expected a database URL (spec or executors.database.dsn)")
        read_only = config.get("read_only", True) is not False
        max_rows = int(config.get("max_rows", DEFAULT_MAX_ROWS))
        if config.get("mode", "template") == "structured":
            statement, params, max_rows = build_structured(config, args, where, max_rows)
        else:
            statement, params = build_template(config, args, where, read_only, spec.input_schema)
        engine = self.engine(dsn)
        ctx.check()
        ctx.progress("querying database")
        token = _connecting.set(ctx)
        try:
            with engine.connect() as conn:
                rows, more = self._execute(conn, statement, params, ctx, read_only, max_rows)
        except sa.exc.DBAPIError as e:
            raise self._translate(e, ctx, where) from e
        except sa.exc.SQLAlchemyError as e:
            raise ExecutorError(f"{where}: {type(e).__name__}: {e}") from e
        finally:
            _connecting.reset(token)
        suffix = f" (more than {max_rows}; only the first {max_rows} returned)" if more else ""
        ctx.progress(f"{len(rows)} rows found{suffix}, formatting")
        return [{k: json_friendly(v) for k, v in row.items()} for row in rows]

    def _execute(
        self,
        conn: Connection,
        statement: Any,
        params: dict[str, Any],
        ctx: ExecContext,
        read_only: bool,
        max_rows: int,
    ) -> tuple[list[dict[str, Any]], bool]:
        dialect = conn.dialect.name
        raw: Any = conn.connection.dbapi_connection  # the driver's own connection (cancel, progress handler)
        trans = conn.begin()
        cancel: Callable[[], None] = lambda: None  # noqa: E731
        try:
            if dialect == "postgresql":
                if read_only:
                    conn.exec_driver_sql("SET TRANSACTION READ ONLY")
                ms = max(1, int(ctx.remaining() * 1000))
                conn.exec_driver_sql(f"SET LOCAL statement_timeout = {ms}")
                cancel = getattr(raw, "cancel_safe", None) or raw.cancel
            elif dialect == "sqlite":
                if read_only:
                    conn.exec_driver_sql("PRAGMA query_only = ON")
                raw.set_progress_handler(
                    lambda: int(ctx.cancelled.is_set() or time.monotonic() >= ctx.deadline), 1000
                )
            self._watch(ctx, cancel)
            try:
                # (streamed: a server-side cursor on PostgreSQL, so max_rows bounds the memory too, not
                # only what is returned; 2,000,000 rows took 320 MB before the first 10 came back)
                streamed = read_only and first_keyword(str(statement)).partition("(")[0] in _QUERY_VERBS
                result = conn.execution_options(stream_results=streamed, max_row_buffer=max_rows + 1).execute(
                    statement, params
                )
                rows = (
                    [dict(r) for r in result.mappings().fetchmany(max_rows + 1)]
                    if result.returns_rows
                    else []
                )
            finally:
                self._unwatch(ctx)
            more = len(rows) > max_rows
            if read_only:
                trans.rollback()
            else:
                trans.commit()
            return rows[:max_rows], more
        finally:
            if trans.is_active:
                trans.rollback()
            if dialect == "sqlite":
                raw.set_progress_handler(None, 0)
                if read_only:
                    conn.exec_driver_sql("PRAGMA query_only = OFF")

    def _translate(self, e: sa.exc.DBAPIError, ctx: ExecContext, where: str) -> HermesError:
        import sqlalchemy as sa

        orig = str(getattr(e, "orig", e)).strip()
        message = orig.splitlines()[0] if orig else str(e)
        if ctx.cancelled.is_set():
            return CallCancelled(f"call {ctx.call_id} was cancelled")
        lowered = message.lower()
        if time.monotonic() >= ctx.deadline or "statement timeout" in lowered or lowered == "interrupted":
            return ToolTimeout(f"{where}: query timed out after {ctx.timeout:g}s", timeout=ctx.timeout)
        retryable = isinstance(e, sa.exc.OperationalError)
        err = ExecutorError(f"{where}: database error: {message}", retryable=retryable)
        err.retryable = retryable
        return err

    def _watch(self, ctx: ExecContext, cancel: Callable[[], None]) -> None:
        """Have one thread, for all in-flight queries, call ``cancel`` if the call is cancelled."""
        with self._lock:
            self._inflight[id(ctx)] = (ctx, cancel)
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._watch_loop, name="db-cancel-watch", daemon=True)
                self._watcher.start()

    def _unwatch(self, ctx: ExecContext) -> None:
        with self._lock:
            self._inflight.pop(id(ctx), None)

    def _watch_loop(self) -> None:
        while True:
            time.sleep(POLL)
            with self._lock:
                if not self._inflight:
                    self._watcher = None
                    return
                due = [(k, c) for k, (ctx, c) in self._inflight.items() if ctx.cancelled.is_set()]
                for key, _ in due:
                    self._inflight.pop(key, None)
            for _, cancel in due:
                with contextlib.suppress(Exception):  # the query may have just finished
                    cancel()

    def close(self) -> None:
        with self._lock:
            for engine in self._engines.values():
                engine.dispose()
            self._engines.clear()


def build_template(
    config: dict[str, Any], args: dict[str, Any], where: str, read_only: bool, schema: Any = None
) -> tuple[Any, dict[str, Any]]:
    """``text()`` with the named bind parameters it mentions, each taken from the arguments."""
    import sqlalchemy as sa

    query = checked_query(where, config.get("query"))
    if read_only and first_keyword(query) not in _READ_VERBS:
        raise InvalidSpec.at(where, "query", "read-only tools may only read (set read_only: false to write)")
    statement = sa.text(query)
    names = list(statement.compile().params)  # the bind parameter names text() found in the SQL
    if missing := [n for n in names if n not in args and not optional(schema, n)]:
        raise InvalidArgs(
            f"{where}: missing value for {', '.join(':' + n for n in missing)}",
            violations=[f"$.{n}: missing" for n in missing],
        )
    return statement, {n: args.get(n) for n in names}  # an optional field left out binds NULL


def build_structured(
    config: dict[str, Any], args: dict[str, Any], where: str, max_rows: int
) -> tuple[Any, dict[str, Any], int]:
    """A Core SELECT from ``{table, columns, where, limit}``, every identifier from the allow-list."""
    import sqlalchemy as sa

    tables = config.get("tables")
    if not isinstance(tables, dict) or not tables:
        raise InvalidSpec(f"{where}: tables: structured mode needs {{table: [columns]}}")
    name = args.get("table")
    if not isinstance(name, str) or name not in tables:
        raise InvalidArgs(
            f"{where}: table {name!r} is not one of {sorted(tables)}", violations=["$.table: not allowed"]
        )
    allowed = [str(c) for c in tables[name] or ()]
    wanted = args.get("columns") or allowed
    if isinstance(wanted, str):
        wanted = [wanted]
    bad = [c for c in wanted if not isinstance(c, str) or c not in allowed]
    filters = args.get("where") or {}
    if not isinstance(filters, dict):
        raise InvalidArgs(f"{where}: where: expected a mapping of column to value")
    bad += [c for c in filters if c not in allowed]
    if bad:
        raise InvalidArgs(
            f"{where}: columns not allowed for {name}: {bad!r}",
            violations=[f"$.columns: {c!r} not allowed" for c in bad],
        )
    limit = args.get("limit", max_rows)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise InvalidArgs(
            f"{where}: limit: expected a non-negative integer", violations=["$.limit: not an integer"]
        )
    limit = min(limit, max_rows)
    tbl = sa.table(name, *(sa.column(c) for c in allowed))
    stmt = sa.select(*(tbl.c[c] for c in wanted))
    for col, value in filters.items():
        if isinstance(value, list):
            stmt = stmt.where(tbl.c[col].in_(value))
        elif value is None:
            stmt = stmt.where(tbl.c[col].is_(None))
        else:
            stmt = stmt.where(tbl.c[col] == value)
    return stmt.limit(limit), {}, limit


def json_friendly(value: Any) -> Any:
    """Database values as msgpack/JSON-friendly ones."""
    if value is None or isinstance(value, str | bool | int | float | bytes):
        return value
    if isinstance(value, decimal.Decimal):  # (an integer past 64 bits, or Infinity, a float: msgpack takes it)
        if value.is_finite() and value == value.to_integral_value() and -(2**63) <= value < 2**64:
            return int(value)
        as_float = float(value)
        return str(value) if value.is_finite() and math.isinf(as_float) else as_float  # (1e400: its digits)
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, memoryview | bytearray):
        return bytes(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, list | tuple):
        return [json_friendly(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_friendly(v) for k, v in value.items()}
    return str(value)

