"""Log lines are scrubbed: structlog events (message, fields, tracebacks) and stdlib records alike."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from broker.logs import RedactFilter, configure

KEY = "sk-" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
PW = "postgresql://app:hunter2x@db:5432/prod"


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
