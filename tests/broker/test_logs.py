"""Log lines are scrubbed: structlog events (message, fields, tracebacks) and stdlib records alike."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from broker import logs
from broker.logs import RedactFilter, configure

KEY = "sk-" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
PW = "postgresql://app:hunter2x@db:5432/prod"


@pytest.fixture(autouse=True)
def _module_state() -> Iterator[None]:
    """configure() sets module-wide figures (level, JSON or not): later tests get them back as they were."""
    saved = (logs._level, logs._json)
    yield
    logs._level, logs._json = saved


@pytest.fixture
def out() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []  # basicConfig only installs a handler on a bare root logger
    try:
        configure("INFO", "json", stream=stream)
        yield stream
    finally:
        root.handlers = saved
        structlog.reset_defaults()


def test_structlog_events_fields_and_tracebacks_are_redacted(out: io.StringIO) -> None:
    log = structlog.get_logger("t")
    log.warning(f"calling with {KEY}", url=PW, headers={"Authorization": "Bearer abcdef123456"})
    try:
        raise RuntimeError(f"login failed password=hunter22 key {KEY}")
    except RuntimeError:
        log.exception("boom")
    text = out.getvalue()
    lines = [json.loads(line) for line in text.splitlines()]
    assert len(lines) == 2 and "RuntimeError" in lines[1]["exception"]
    for secret in (KEY, "hunter2x", "hunter22", "abcdef123456"):
        assert secret not in text


def test_stdlib_records_are_redacted_including_args_and_exc_info(out: io.StringIO) -> None:
    plugin_log = logging.getLogger("hermes_plugins.leaky")
    plugin_log.warning("token is %s for %s", KEY, PW)
    try:
        raise ValueError(f"bad {KEY}")
    except ValueError:
        plugin_log.exception("failed")
    text = out.getvalue()
    assert "token is" in text and "ValueError" in text and "***" in text
    assert KEY not in text and "hunter2x" not in text


def test_configure_twice_installs_one_filter_per_handler(out: io.StringIO) -> None:
    configure("INFO", "json", stream=out)
    for handler in logging.getLogger().handlers:
        assert sum(isinstance(f, RedactFilter) for f in handler.filters) == 1


# -- the lines a call emits -------------------------------------------------------------------------

CALL = {
    "call_id": "22abb8081e944e1086a9d8a9339d9486",
    "trace_id": "dc2ba6c1dbf02ceb442ee92e079f3c0b",
    "span_id": "e03e5431d4303650",
    "tool": "get_weather",
}


@pytest.fixture
def bound() -> Iterator[None]:
    structlog.contextvars.bind_contextvars(**CALL)
    yield
    structlog.contextvars.clear_contextvars()


def test_json_lines_parse_and_carry_the_fields_bound_for_the_call(out: io.StringIO, bound: None) -> None:
    structlog.get_logger("hermes.worker").info("call finished", state="done", duration_ms=1.5)
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert {k: line[k] for k in CALL} == CALL
    assert line["event"] == "call finished" and line["level"] == "info" and line["duration_ms"] == 1.5
    assert line["timestamp"].endswith("Z")


def test_a_secret_in_a_field_that_is_not_a_hex_id_is_still_masked(out: io.StringIO) -> None:
    structlog.contextvars.bind_contextvars(call_id=KEY, trace_id="not-hex " + KEY)
    try:
        structlog.get_logger("t").warning("call finished")
    finally:
        structlog.contextvars.clear_contextvars()
    assert KEY not in out.getvalue() and "***" in out.getvalue()


def test_console_lines_are_human_readable_and_the_level_filters(bound: None) -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []
    try:
        configure("WARNING", "console", stream=stream)
        log = structlog.get_logger("hermes.worker")
        log.info("call started")
        log.warning("call finished", state="failed", error_type="executor_error")
    finally:
        root.handlers = saved
        structlog.reset_defaults()
    (line,) = stream.getvalue().splitlines()
    assert not line.startswith("{") and "call finished" in line and "[warning" in line
    assert "error_type=executor_error" in line and f"span_id={CALL['span_id']}" in line


def test_in_json_mode_stdlib_records_are_json_lines_too_with_their_fields_scrubbed(out: io.StringIO) -> None:
    # `logging.level: DEBUG` + `--log-format json` (the seed's tip): every line parses, plugins' included.
    logging.getLogger("hermes_plugins.demo").warning("plugin says %s", "hi")
    logging.getLogger("hermes.middleware").warning(
        "tool_request callback failed", extra={"hermes": {"error_type": "KeyError", "error": f"bad {KEY}"}}
    )
    try:
        raise ValueError("nope")
    except ValueError:
        logging.getLogger("hermes_plugins.demo").exception("it failed")
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [(x["logger"], x["level"], x["event"]) for x in lines] == [
        ("hermes_plugins.demo", "warning", "plugin says hi"),
        ("hermes.middleware", "warning", "tool_request callback failed"),
        ("hermes_plugins.demo", "error", "it failed"),
    ]
    assert lines[1]["error_type"] == "KeyError" and KEY not in lines[1]["error"] and "***" in lines[1]["error"]
    assert "ValueError: nope" in lines[2]["exception"] and all(x["timestamp"].endswith("Z") for x in lines)


def test_debug_reaches_our_loggers_but_libraries_stay_at_warning() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    root.handlers = []
    # (a worker core made by an earlier test in this process set the plugins' namespace to its level)
    plugins = logging.getLogger("hermes_plugins")
    plugins_level = plugins.level
    plugins.setLevel(logging.NOTSET)
    try:
        configure("DEBUG", "json", stream=stream)
        logging.getLogger("hermes_plugins.demo").debug("ours")
        logging.getLogger("httpx").debug("theirs")
    finally:
        root.handlers = saved
        root.setLevel(level)
        plugins.setLevel(plugins_level)
        structlog.reset_defaults()
    assert [json.loads(x)["event"] for x in stream.getvalue().splitlines()] == ["ours"]


# -- the cheap path every call's lines take (issue #30) --------------------------------------------


def _console(level: str = "INFO") -> tuple[io.StringIO, list[logging.Handler]]:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []
    configure(level, "console", stream=stream)
    return stream, saved


def test_console_call_lines_carry_the_call_and_trace_ids_and_sorted_fields(bound: None) -> None:
    stream, saved = _console()
    try:
        log = structlog.get_logger("hermes.worker")
        log.info("call started", attempt=1, queue_wait_ms=0.25)
        log.info("call finished", state="done", duration_ms=1.5)
    finally:
        logging.getLogger().handlers = saved
        structlog.reset_defaults()
    started, finished = stream.getvalue().splitlines()
    assert "[info     ] call started" in started and "attempt=1 call_id=" in started
    for line in (started, finished):
        assert f"call_id={CALL['call_id']}" in line and f"trace_id={CALL['trace_id']}" in line
        assert line.startswith("20") and "Z [info" in line
    assert "duration_ms=1.5 " in finished and "state=done " in finished  # keys sorted, numbers as repr


def test_console_lines_mask_secrets_by_key_and_by_shape_every_time_a_value_repeats() -> None:
    # Short strings' scans are remembered: the second line with the same text must be masked too.
    stream, saved = _console()
    try:
        log = structlog.get_logger("hermes.worker")
        for _ in range(2):
            log.info(f"calling with {KEY}", api_key=12345, note=f"url {PW}", args={"password": "hunter22"})
        log.info("long", text="x" * 300 + " " + KEY)  # past the remembered length: scanned each time
    finally:
        logging.getLogger().handlers = saved
        structlog.reset_defaults()
    text = stream.getvalue()
    for secret in (KEY, "hunter2x", "hunter22", "12345"):
        assert secret not in text
    assert text.count("api_key=***") == 2 and text.count("***") >= 9


def test_console_exceptions_come_under_their_line_scrubbed() -> None:
    stream, saved = _console()
    try:
        try:
            raise RuntimeError(f"login failed password=hunter22 key {KEY}")
        except RuntimeError:
            structlog.get_logger("hermes.worker").exception("call crashed in the worker")
        logging.getLogger("hermes_plugins.demo").warning("plugin says %s", "hi")
    finally:
        logging.getLogger().handlers = saved
        structlog.reset_defaults()
    lines = stream.getvalue().splitlines()
    assert "[error    ] call crashed in the worker" in lines[0] and lines[1] == "Traceback (most recent call last):"
    assert any(x.startswith("RuntimeError: login failed") for x in lines)
    assert "[hermes_plugins.demo]" in lines[-1] and "plugin says hi" in lines[-1]
    assert KEY not in stream.getvalue() and "hunter22" not in stream.getvalue()


def test_json_lines_keep_secret_named_numbers_masked_and_exceptions_as_text(out: io.StringIO) -> None:
    structlog.get_logger("t").warning("x", token=123, max_tokens=50, error=ValueError(f"bad {KEY}"))
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert line["token"] == "***" and line["max_tokens"] == 50
    assert line["error"].startswith("ValueError: bad ") and KEY not in line["error"]


class _Pipe(io.StringIO):
    """A stream that keeps each write() apart, as a pipe shared by a pool's processes sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def _busy(monkeypatch: pytest.MonkeyPatch, every: float = 3600.0) -> tuple[_Pipe, logs.BatchedLines]:
    """A writer that wrote a line just now (a busy worker), flushing every ``every`` seconds (by default
    only when the test asks)."""
    monkeypatch.setattr(logs.BatchedLines, "EVERY", every)
    pipe = _Pipe()
    lines = logs.BatchedLines(pipe)
    lines._last = time.monotonic()
    return pipe, lines


def test_a_workers_lines_are_written_a_batch_at_a_time_whole_and_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, lines = _busy(monkeypatch)
    for i in range(300):
        lines.info(f"line {i:03d} " + "x" * 40)
    assert pipe.writes == []  # queued: no system call in the call's thread
    lines.flush()
    assert all(len(w) <= logs.BatchedLines.CHUNK and w.endswith("\n") for w in pipe.writes)
    assert len(pipe.writes) > 1  # split on whole lines under PIPE_BUF
    assert pipe.getvalue().splitlines() == [f"line {i:03d} " + "x" * 40 for i in range(300)]


def test_a_warning_goes_out_at_once_after_the_lines_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, lines = _busy(monkeypatch)
    lines.info("call finished a")
    assert pipe.writes == []
    lines.warning("call finished b failed")
    assert pipe.getvalue().splitlines() == ["call finished a", "call finished b failed"]


def test_a_quiet_workers_line_goes_out_at_once() -> None:
    pipe = _Pipe()
    lines = logs.BatchedLines(pipe)  # (nothing written for EVERY seconds: startup, an idle worker)
    lines.info("plugins loaded")
    assert pipe.writes == ["plugins loaded\n"]
    lines.info("worker started")  # (one just went out: this one waits for the batch)
    assert pipe.writes == ["plugins loaded\n"]


def test_queued_lines_go_out_within_the_interval_and_a_broken_stream_loses_lines_not_the_worker(
    monkeypatch: pytest.MonkeyPatch, wait_until: Any
) -> None:
    pipe, lines = _busy(monkeypatch, 0.05)
    lines.info("soon")
    assert pipe.writes == []
    wait_until(lambda: "soon" in pipe.getvalue(), 5, 0.01, message="the queued line")
    assert pipe.getvalue() == "soon\n"
    pipe.close()
    lines._last = 0.0
    lines.error("into a closed stream")  # no exception


def test_a_worker_configured_batched_writes_its_call_lines_through_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs.BatchedLines, "EVERY", 3600.0)
    pipe = _Pipe()
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []
    try:
        configure("INFO", "console", stream=pipe, batched=True)
        assert logs._batched is not None
        logs._batched._last = time.monotonic()  # (busy)
        logs.call_log().info("call finished", state="done")
        assert pipe.writes == []
        logs.call_log().warning("call finished", state="failed")
    finally:
        root.handlers = saved
        structlog.reset_defaults()
    written = pipe.getvalue().splitlines()
    assert len(written) == 2 and "state=done" in written[0] and "state=failed" in written[1]
