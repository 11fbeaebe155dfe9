"""structlog set-up: human-readable by default, JSON lines with ``--log-format json``."""

from __future__ import annotations

import atexit
import logging
import re
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from functools import lru_cache
from typing import Any

import structlog

from .redact import MASK, RedactProcessor, is_secret_key, redact, redact_text
from .settings import shortcut_on

# Fields every call's lines carry that cannot hold a secret: ids we mint or validated as hex, and what
# the processors before redaction added. Scanning them costs more than the rest of a line (measured).
_GENERATED = frozenset(("timestamp", "level"))
_IDS = frozenset(("call_id", "trace_id", "span_id"))
# A hex id, or a call id: its queue's hash tag, a dot and hex ("{tools}.9f2c..."); the tag is scanned.
_ID = re.compile(r"(\{[^{}]*\}\.)?[0-9a-f]{8,64}")
_SCALARS = (int, float, bool, type(None))
_SHORT = 256  # strings up to this long are scanned once per distinct value (messages, tool names, states)


_STOCK = RedactProcessor()


@lru_cache(maxsize=4096)
def _redact_short(text: str) -> str:
    return redact_text(text)


def redact_event(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> Mapping[str, Any]:
    """The redaction processor (``broker.redact``) over an event's fields, made cheap for the lines every
    call writes: generated stamps and hex ids are not scanned, numbers are kept, and a short string's
    scan is remembered (the same message, tool name or state comes back on every call). With
    ``workers.shortcuts_off: [redaction]``, ``RedactProcessor`` over the whole event instead."""
    if not shortcut_on("redaction"):
        return _STOCK(logger, method_name, event_dict)
    out: dict[str, Any] = {}
    for key, value in event_dict.items():
        kind = type(value)
        if key in _GENERATED:
            out[key] = value
        elif is_secret_key(key):  # (str keys only: structlog's are)
            out[key] = value if value is None or value == "" else MASK
        elif kind is str:
            match = _ID.fullmatch(value) if key in _IDS else None
            if match:
                tag = match.group(1)
                out[key] = value if tag is None or _redact_short(tag) == tag else MASK
            else:
                out[key] = _redact_short(value) if len(value) <= _SHORT else redact_text(value)
        elif kind in _SCALARS:
            out[key] = value
        elif isinstance(value, BaseException):  # rendered with str() later: clean that text now
            out[key] = redact_text(f"{type(value).__name__}: {value}")
        else:
            out[key] = redact(value)
    return out


def stamp(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """``timestamp``: ISO 8601 in UTC with microseconds, as ``TimeStamper(fmt="iso", utc=True)`` writes it,
    at a fifth of its cost (the date and time of day are formatted once a second)."""
    global _second
    now = time.time()
    whole = int(now)
    second, text = _second
    if whole != second:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
        _second = (whole, text)  # (one tuple: threads read a consistent pair)
    event_dict["timestamp"] = f"{text}.{int((now - whole) * 1e6):06d}Z"
    return event_dict


_second = (-1, "")


class ConsoleLines:
    """structlog renderer: ``<time> [<level>] <event> key=value ...`` and the traceback under it.

    The layout of structlog's ``ConsoleRenderer(colors=False)`` at a tenth of its cost (it writes each
    field through a StringIO and pads every column), which is what every call's two lines paid.
    """

    def __call__(self, logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> str:
        ts = event_dict.pop("timestamp", None)
        level = event_dict.pop("level", method_name)
        event = event_dict.pop("event", "")
        name = event_dict.pop("logger", None) or event_dict.pop("logger_name", None)
        tail = [str(event_dict.pop(k)) for k in ("stack", "exception") if event_dict.get(k)]
        head = f"{ts} [{level:<9}] {event!s:<30}" if ts else f"[{level:<9}] {event!s:<30}"
        if name:
            head = f"{head} [{name}]"
        fields = " ".join(f"{k}={v}" if type(v) is str else f"{k}={v!r}" for k, v in sorted(event_dict.items()))
        line = f"{head} {fields}" if fields else head.rstrip()
        return "\n".join([line, *tail]) if tail else line


_level = logging.INFO  # the level configure() set; structlog's default when it was never called


def info_enabled() -> bool:
    """Whether an info line would be written.

    For the lines every call emits: with ``cache_logger_on_first_use`` off (so configure() may run again),
    a filtered-out ``log.info`` still builds a bound logger first, ~20 us a call measured.
    """
    return _level <= logging.INFO


_calls: Any = None  # the logger of every call's lines, made by configure()


def call_log() -> Any:
    """The logger of the lines every call writes (``call finished``; ``call started`` at DEBUG), bound once per
    configure(): ``structlog.get_logger()`` assembles a new bound logger on every line (``cache_logger_on_first_use``
    is off so that configure() may run again), ~10 us a line measured in a busy worker."""
    return _calls if _calls is not None else structlog.get_logger("hermes.worker")


_json = False  # whether configure() chose JSON lines
_batched: BatchedLines | None = None  # a worker's line writer (configure(batched=True))


def flush() -> None:
    """Write a worker's queued lines now (``BatchedLines``): after its start-up lines, say."""
    if _batched is not None:
        _batched.flush()


def debug_enabled() -> bool:
    """Whether configure() asked for DEBUG lines."""
    return _level <= logging.DEBUG


def json_lines() -> bool:
    """Whether log lines are JSON (``--log-format json``): a command's notices on stderr are then log lines too."""
    return _json


def configure(level: str = "INFO", fmt: str = "console", stream: Any = None, batched: bool = False) -> None:
    """Configure structlog and stdlib logging once per process (``batched``: a worker's, see ``BatchedLines``)."""
    global _level, _json, _calls, _batched
    lvl = getattr(logging, str(level).upper(), logging.INFO)
    _level = lvl
    _json = fmt == "json"
    _batched = BatchedLines(stream or sys.stderr) if batched else None
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = ConsoleLines()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamp,
            structlog.processors.format_exc_info,
            # After format_exc_info, so a traceback's text is scrubbed too; no secret reaches a log line.
            redact_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # One write() per line (message and newline together): the processes of a pool share one stderr,
        # and lines written in two parts came out glued to another process's.
        logger_factory=_OneWriter(stream or sys.stderr, _batched),
        cache_logger_on_first_use=False,
    )
    _calls = structlog.get_logger("hermes.worker").bind()
    # Records of stdlib loggers (plugins, libraries) come out in the same format: JSON lines in JSON mode.
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "hermes_handler", False)]:
        root.removeHandler(old)  # configure() again (another level or format) replaces our handler
    if not root.handlers:
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.hermes_handler = True  # type: ignore[attr-defined]
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, redact_event, renderer],
                foreign_pre_chain=[
                    structlog.stdlib.add_logger_name,
                    structlog.processors.add_log_level,
                    stamp,
                    _record_extras,
                ],
            )
        )
        # Our loggers and plugins' follow the configured level; libraries' stay at WARNING, one line each.
        handler.addFilter(_QuietLibraries())
        handler.addFilter(LibraryRecords())
        root.addHandler(handler)
        root.setLevel(lvl)
    for each in root.handlers:
        if not any(isinstance(f, RedactFilter) for f in each.filters):
            each.addFilter(RedactFilter())


class _OneWriter:
    """The logger factory: every logger writes through one logger (structlog's factory made one per log
    line, with ``cache_logger_on_first_use`` off): a ``WriteLogger``, or a ``BatchedLines`` (workers)."""

    def __init__(self, stream: Any, batched: BatchedLines | None = None) -> None:
        self.logger: Any = batched if batched is not None else structlog.WriteLogger(stream)

    def __call__(self, *args: Any) -> Any:
        return self.logger


class BatchedLines:
    """A worker's log lines written a batch at a time by a thread of their own, each write whole lines of
    at most ``PIPE_BUF`` bytes (the processes of a pool share one stderr: such a write is never cut by
    another's). A worker thread that wrote its line itself released the interpreter lock for the system
    call and then waited to get it back behind the other call threads, with every call's ``call finished``
    line (bench/throughput.py: ``info_vs_warning``). Lines at WARNING and above go out at once, after
    those before them, and so does a line after ``EVERY`` seconds without one (startup, a quiet worker);
    the rest within ``EVERY`` seconds, and at exit."""

    EVERY = 0.02
    CHUNK = 4096  # PIPE_BUF on Linux

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._lines: list[str] = []
        self._lock = threading.Lock()  # guards _lines
        self._io = threading.Lock()  # one writer at a time, in order
        self._last = 0.0  # time.monotonic() of the last flush
        threading.Thread(target=self._loop, name="hermes-log-lines", daemon=True).start()
        atexit.register(self.flush)

    def _queue(self, message: str) -> None:
        with self._lock:
            self._lines.append(message)
            idle = len(self._lines) == 1 and time.monotonic() - self._last >= self.EVERY
        if idle:  # a quiet worker's line goes out at once: only lines that come in a rush wait for the batch
            self.flush()

    def _now(self, message: str) -> None:
        self._queue(message)
        self.flush()

    msg = log = debug = info = _queue
    warn = warning = error = err = critical = fatal = exception = failure = _now

    def _loop(self) -> None:
        while True:
            time.sleep(self.EVERY)
            self.flush()

    def flush(self) -> None:
        with self._io:
            with self._lock:
                lines, self._lines = self._lines, []
                if lines:
                    self._last = time.monotonic()
            if not lines:
                return
            chunk: list[str] = []
            size = 0
            try:
                for line in lines:
                    n = len(line) + 1
                    if chunk and size + n > self.CHUNK:
                        self._stream.write("\n".join(chunk) + "\n")
                        chunk, size = [], 0
                    chunk.append(line)
                    size += n
                self._stream.write("\n".join(chunk) + "\n")
                self._stream.flush()
            except (OSError, ValueError):  # a closed or broken stderr loses the lines, not the worker
                pass


def _record_extras(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A stdlib record's fields (``extra={"hermes": {...}}``) and its traceback, which ``RedactFilter``
    has already formatted and scrubbed into ``exc_text``."""
    record = event_dict.get("_record")
    fields = getattr(record, "hermes", None)
    if isinstance(fields, Mapping):
        for key, value in fields.items():
            event_dict.setdefault(str(key), value)
    if record is not None and record.exc_text:
        event_dict["exception"] = record.exc_text
    return event_dict


class LibraryRecords(logging.Filter):
    """redis-py's records as one line at WARNING at most: the exception named in the message, its
    traceback dropped (unless DEBUG is configured). A failover makes redis-py log errors with tracebacks
    for what the gateway retries and reports itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(LIBRARIES) or _level <= logging.DEBUG:
            return True
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        if record.exc_info:
            error = record.exc_info[1]
            message = record.getMessage()
            if error is not None and str(error) and str(error) not in message:
                message = f"{message} ({error})"
            record.msg, record.args, record.exc_info, record.exc_text = message, None, None, None
        return True


LIBRARIES = ("redis.",)  # loggers whose records LibraryRecords shortens


class _LastResort(logging.Handler):
    """redis-py's records in a process whose application configured no logging: one line on stderr at
    WARNING (Python's own last resort prints each with its traceback). Where the root logger has a handler
    (``configure()``'s, or the application's), that handler decides alone."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.addFilter(LibraryRecords())
        self.addFilter(RedactFilter())
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def handle(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        if logging.getLogger().handlers:
            return False
        return bool(super().handle(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")  # (the stream of the moment, as the last resort's)
        except Exception:  # noqa: BLE001 - logging must never raise into redis-py
            self.handleError(record)


def library_logs() -> None:
    """Give redis-py's loggers a one-line handler of last resort (once per process): a client library must
    not configure the application's logging, but neither print redis-py's tracebacks on its stderr."""
    redis_logger = logging.getLogger("redis")
    if not any(isinstance(h, _LastResort) for h in redis_logger.handlers):
        redis_logger.addHandler(_LastResort())


class _QuietLibraries(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.startswith(("hermes.", "hermes_plugins"))


class RedactFilter(logging.Filter):
    """Scrubs stdlib log records (plugins log through ``logging``) the way the structlog processor does."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact_text(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and record.exc_info[0] is not None:
            # The handler would format the traceback later, unscrubbed: format it now and clean it.
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text, record.exc_info = redact_text(text), None
        return True

