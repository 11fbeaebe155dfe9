"""Redaction, so secrets never reach logs, events, spans or the audit log; then structlog set-up:
human-readable by default, JSON lines with ``--log-format json``."""

from __future__ import annotations

import atexit
import hashlib
import hmac
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from functools import lru_cache
from typing import Any
from urllib.parse import quote, quote_plus, unquote_plus

import structlog

from .codec import MAX_DEPTH as ARGS_DEPTH
from .codec import pack
from .settings import shortcut_on

# -- redaction --------------------------------------------------------------------------------------
# A secret is recognised by the key it sits under and by its shape inside any string. Arguments a tool
# declares ``sensitive`` are masked; the audit record keeps a keyed hash of each (``keyed_hash``), so a replay
# can check it was given the same value while nobody can find a short one (a PIN) by hashing every candidate.

MASK = "***"
HASH_PREFIX = "sha256:"
KEYED_PREFIX = "hmac-sha256:"
MAX_DEPTH = 32
_CLIP_MARGIN = 512  # clipped text is scanned this far past its cut

# Keys whose value is a secret, matched case-insensitively anywhere in the key ("github_token").
_SECRET_KEY = re.compile(
    r"passw(or)?d|passphrase|pwd|secret|token|api[-_]?key|access[-_]?key|private[-_]?key|authorization"
    r"|cookie|credential|session[-_]?key|signature|(^|[-_])auth([-_]|$)|bearer|dsn|connection[-_]?string",
    re.IGNORECASE,
)
# ... except these, which only look like it: LLM token counts and settings are not secrets.
_NOT_SECRET_KEY = re.compile(
    r"(max|min|prompt|completion|total|input|output|cached|cache|reasoning|num|context|remaining|used)"
    r"[-_]?(completion[-_]?)?tokens?\b|tokens?[-_](count|limit|usage|budget|type|ids?|used|remaining)\b"
    r"|tokenizer|secret[-_](name|ref|id)\b|password[-_](policy|length|min|max)",
    re.IGNORECASE,
)

# Secret shapes inside strings, each a named group (``_replace`` decides what to keep); key prefixes such
# as ``AKIA`` are case-sensitive.
_PATTERNS: tuple[tuple[str, str], ...] = (
    # PEM private key blocks, also truncated ones (no END line).
    (
        "pem",
        r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----(?:.*?-----END[A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----|.*\Z)",
    ),
    # Passwords in URLs: scheme://user:password@host keeps scheme, user and host.
    (
        "url",
        r"(?P<url_head>(?<![a-zA-Z0-9+.\-])[a-zA-Z][a-zA-Z0-9+.\-]*://[^:/?#@\s]*:)(?P<url_pw>[^@/?#\s]+)(?=@)",
    ),
    # HTTP auth headers as text: "Authorization: Bearer abc", "Cookie: a=b".
    (
        "hdr",
        r"(?P<hdr_head>(?i:\b(?:proxy-)?(?:authorization|x-api-key|api-key|x-auth-token|cookie|set-cookie))"
        r"\\*[\"']?\s*[:=]\s*\\*[\"']?)(?P<hdr_val>[^\r\n\"'\\]+)",
    ),
    # Auth schemes followed by a credential.
    (
        "scheme",
        r"(?P<scheme_head>(?i:\b(?P<scheme_name>Bearer|Basic|Token|Digest))\s+)(?P<scheme_val>[A-Za-z0-9\-._~+/]{3,}=*)",
    ),
    # JWT (three base64url segments, header and payload are JSON objects: "eyJ").
    ("jwt", r"(?<![A-Za-z0-9_\-])eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"),
    # Well-known key shapes.
    (
        "key",
        r"(?<![A-Za-z0-9_\-])(?:"
        r"sk-(?:proj-|ant-(?:api|admin)\d\d-|svcacct-)?[A-Za-z0-9_\-]{20,}"  # OpenAI, Anthropic, DeepSeek
        r"|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}"  # Stripe
        r"|whsec_[A-Za-z0-9]{20,}"  # Stripe webhook secret
        r"|gh[pousr]_[A-Za-z0-9]{30,}"  # GitHub
        r"|github_pat_[A-Za-z0-9_]{40,}"
        r"|glpat-[A-Za-z0-9_\-]{20,}"  # GitLab
        r"|xox[abposr]-[A-Za-z0-9\-]{10,}"  # Slack
        r"|(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}"  # AWS access key id
        r"|AIza[0-9A-Za-z_\-]{35}"  # Google API key
        r"|ya29\.[0-9A-Za-z_\-]{20,}"  # Google OAuth access token
        r"|hf_[A-Za-z0-9]{30,}"  # Hugging Face
        r"|npm_[A-Za-z0-9]{36}"  # npm
        r"|pypi-[A-Za-z0-9_\-]{50,}"  # PyPI
        r"|SG\.[A-Za-z0-9_\-]{16,}\.[A-Za-z0-9_\-]{16,}"  # SendGrid
        r"|shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}"  # Shopify
        r"|dop_v1_[a-f0-9]{64}"  # DigitalOcean
        r"|key-[0-9a-zA-Z]{32}"  # Mailgun
        r"|gsk_[A-Za-z0-9]{40,}"  # Groq
        r"|r8_[A-Za-z0-9]{30,}"  # Replicate
        r")",
    ),
    ("slackhook", r"https://hooks\.slack\.com/services/[A-Za-z0-9/_\-]+"),
    # A URL's `key` / `sig` query parameter (Google-style API keys, signed URLs).
    ("qp", r"(?P<qp_head>[?&](?i:key|sig|signature)=)[^\s&#\"'<>]{3,}"),
    ("tg", r"\b\d{8,10}:AA[A-Za-z0-9_\-]{30,}"),  # Telegram bot token
    # key=value / "key": "value" in free text, also JSON quoted inside JSON text ({\"password\":\"...\"}).
    (
        "kv",
        r"(?P<kv_head>(?<![A-Za-z0-9_\-])[\"']?(?i:[A-Za-z0-9_\-]*(?:passw(?:or)?d|passphrase|pwd|secret|token"
        r"|api[-_]?key|access[-_]?key|private[-_]?key|accountkey|sharedaccesskey))"
        r"\\*[\"']?\s*[:=]\s*\\*[\"']?)(?P<kv_val>(?:[^\s\"'\\&,;}{)\]]|\\(?![\\\"'])){3,})",
    ),
)

_SCAN = re.compile("|".join(f"(?P<{name}>{rx})" for name, rx in _PATTERNS), re.DOTALL)
# Words that follow "Bearer"/"Token" in prose, not credentials.
_PROSE = frozenset({"token", "tokens", "auth", "authentication", "authorization", "scheme", "header", "is"})

_SCALARS = (int, float, bool, type(None))


def _replace(m: re.Match[str]) -> str:
    kind = m.lastgroup
    if kind == "url":
        return m.group("url_head") + MASK
    if kind == "hdr":
        return m.group("hdr_head") + MASK
    if kind == "qp":
        return m.group("qp_head") + MASK
    if kind == "scheme":
        prose = _is_prose(m.group("scheme_name"), m.group("scheme_val"))
        return m.group(0) if prose else m.group("scheme_head") + MASK
    if kind == "kv":
        return m.group(0) if _NOT_SECRET_KEY.search(m.group("kv_head")) else m.group("kv_head") + MASK
    return MASK


def _is_prose(scheme: str, value: str) -> bool:
    # "Bearer abc" is a credential; "Basic authentication" or "Token expired" is a sentence.
    if value.lower() in _PROSE:
        return True
    if scheme.lower() == "bearer":
        return False
    return len(value) < 8 or (value.isalpha() and (value.islower() or value[1:].islower()))


def redact_text(text: str) -> str:
    """Mask every secret-shaped span in free text (exception messages, log lines, command output)."""
    if len(text) < 5:
        return text
    return _SCAN.sub(_replace, text)


@lru_cache(maxsize=4096)
def is_secret_key(key: str) -> bool:
    """True when a mapping key names a secret (``api_key``, ``X-Api-Key``, ``github_token``, ...)."""
    return bool(_SECRET_KEY.search(key)) and not _NOT_SECRET_KEY.search(key)


def secret_values(args: Mapping[str, Any], sensitive: Iterable[str] = ()) -> list[str]:
    """The argument values a message must not show: those of ``sensitive`` fields and of secret-named keys
    (text of four characters or more), longest first."""
    named = set(sensitive)
    found: set[str] = set()
    for k, v in args.items():
        if k in named or is_secret_key(str(k)):
            _leaves(v, found, 0)
    # (and as a URL carries it: a back end's error may quote the request line, /echo/AbC%2BdEf%3D...)
    found |= {form for v in list(found) for form in (quote(v, safe=""), quote_plus(v), quote(v))}
    return sorted((v for v in found if len(v) >= 4), key=len, reverse=True)


def _leaves(value: Any, into: set[str], depth: int) -> None:
    # A secret's text, or every text inside it when it is an object or a list (a message may quote the
    # whole value: "{'x': 'hunter2'} is not of type 'integer'").
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        into.add(str(value))
    elif depth < ARGS_DEPTH and isinstance(value, Mapping):
        for item in value.values():
            _leaves(item, into, depth + 1)
    elif depth < ARGS_DEPTH and isinstance(value, list | tuple):
        for item in value:
            _leaves(item, into, depth + 1)


def scrub(text: str, values: Iterable[str]) -> str:
    """``text`` with each of ``values`` (``secret_values``) shown as ``***``."""
    for value in values:
        if value in text:
            text = text.replace(value, "***")
    return text


def scrub_all(value: Any, values: Sequence[str], depth: int = 0) -> Any:
    """``scrub`` on every text in ``value`` and the mappings and lists it holds (an error's details: its
    ``violations`` quote the arguments)."""
    if isinstance(value, str):
        return scrub(value, values)
    if depth < ARGS_DEPTH and isinstance(value, Mapping):
        return {k: scrub_all(v, values, depth + 1) for k, v in value.items()}
    if depth < ARGS_DEPTH and isinstance(value, list | tuple):
        return [scrub_all(v, values, depth + 1) for v in value]
    return value


def hash_value(value: Any) -> str:
    """``sha256:<hex>`` of a value's canonical msgpack form: the same value always hashes the same."""
    return HASH_PREFIX + hashlib.sha256(pack(_canonical(value))).hexdigest()


def keyed_hash(key: bytes) -> Callable[[Any], str]:
    """``hmac-sha256:<hex>`` of a value's canonical msgpack form under ``key`` (the deployment's audit key)."""
    return lambda value: KEYED_PREFIX + hmac.new(key, pack(_canonical(value)), hashlib.sha256).hexdigest()


def verify_hash(value: Any, digest: str, keyed: Callable[[Any], str] | None = None) -> bool:
    """True when ``value`` is the value that produced ``digest`` (replay checks supplied secrets): a keyed one
    with ``keyed``, a plain sha256 (records written before keyed hashes) without."""
    made = hash_value(value) if digest.startswith(HASH_PREFIX) else keyed(value) if keyed else ""
    return hmac.compare_digest(made, digest)


def sensitive_hashes(
    args: Mapping[str, Any] | None, sensitive_fields: Iterable[str], digest: Callable[[Any], str]
) -> dict[str, str]:
    """``{field: digest(value)}`` for each sensitive top-level argument present in ``args``."""
    if not args:
        return {}
    return {f: digest(args[f]) for f in sensitive_fields if f in args}


def redact(
    value: Any, sensitive_fields: Iterable[str] = (), max_text: int | None = None,
    digest: Callable[[Any], str] | None = None,
) -> Any:
    """A redacted copy of ``value``; top-level keys in ``sensitive_fields`` become ``digest(value)`` (the audit
    log's keyed hash), else ``***``. ``max_text``: a longer string keeps its first ``max_text`` characters and
    says how many more there were."""
    if type(value) in _SCALARS:
        return value
    fields = frozenset(sensitive_fields)
    if fields and isinstance(value, Mapping):
        return {
            k: (digest(v) if digest is not None else MASK)
            if k in fields
            else (_mask_keyed(v) if _key_is_secret(k) else _redact(v, 1, max_text))
            for k, v in value.items()
        }
    return _redact(value, 0, max_text)


def clip_text(text: str, limit: int) -> str:
    """The first ``limit`` characters of ``text``, redacted (the scan reaches past the cut, so a secret
    straddling it is masked), and how many more there were."""
    if len(text) <= limit:
        return redact_text(text)
    return f"{redact_text(text[: limit + _CLIP_MARGIN])[:limit]}…[{len(text) - limit} more characters]"


def _key_is_secret(key: Any) -> bool:
    return isinstance(key, str) and is_secret_key(key)


def _mask_keyed(value: Any) -> Any:
    # Keep "not set" visible: an empty or missing secret leaks nothing and explains many failures.
    if value is None or value == "":
        return value
    return MASK


def _redact(value: Any, depth: int, max_text: int | None = None) -> Any:
    if type(value) in _SCALARS:
        return value
    if isinstance(value, str):
        return redact_text(value) if max_text is None else clip_text(value, max_text)
    if depth >= MAX_DEPTH:
        return "<too deep>"
    if isinstance(value, Mapping):
        return {
            k: _mask_keyed(v) if _key_is_secret(k) else _redact(v, depth + 1, max_text) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        # Header lists: [("Authorization", "Bearer ..."), ...] hide the value of a secret-named pair.
        if len(value) == 2 and isinstance(value, tuple) and _key_is_secret(value[0]):
            return (value[0], _mask_keyed(value[1]))
        items = [_redact(v, depth + 1, max_text) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, set | frozenset):
        return type(value)(_redact(v, depth + 1, max_text) for v in value)
    if isinstance(value, bytes | bytearray):
        if max_text is not None and len(value) > max_text:
            return f"<{len(value)} bytes>"
        try:
            text = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return value
        cleaned = redact_text(text)
        return value if cleaned == text else cleaned.encode("utf-8")
    return value


def _canonical(value: Any) -> Any:
    if isinstance(value, Mapping):
        return [[k, _canonical(value[k])] for k in sorted(value, key=str)]
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((_canonical(v) for v in value), key=lambda v: json.dumps(v, default=str))
    return value


class RedactProcessor:
    """structlog processor: redacts every event dict (put it after ``format_exc_info``, before rendering)."""

    def __init__(self, sensitive_fields: Iterable[str] = ()) -> None:
        self.sensitive_fields = frozenset(sensitive_fields)

    def __call__(self, logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> dict[str, Any]:
        out = redact(event_dict, self.sensitive_fields)
        for key, val in out.items():
            # Exceptions bound as values are rendered with str()/repr() later: clean that text now.
            if isinstance(val, BaseException):
                out[key] = redact_text(f"{type(val).__name__}: {val}")
        return out


redact_processor = RedactProcessor()


def redact_url(url: str) -> str:
    """The URL without its passwords, for messages, status and run files: the userinfo password
    (``redis://user:pw@host``) and every secret-named query parameter (``redis://host/0?password=pw``,
    which redis-py reads too) become ``***``; the rest is left as written."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, hash_, fragment = rest.partition("#")
    rest, qmark, query = rest.partition("?")
    if "@" in rest:  # (a password may hold a "/": the last "@" ends the userinfo)
        creds, host = rest.rsplit("@", 1)
        if ":" in creds:
            rest = f"{creds.split(':', 1)[0]}:***@{host}"
    if query:
        query = "&".join(_masked_param(p) for p in query.split("&"))
    return f"{scheme}://{rest}{qmark}{query}{hash_}{fragment}"


def _masked_param(param: str) -> str:
    name, eq, value = param.partition("=")
    key = unquote_plus(name)
    secret = eq and value and (is_secret_key(key) or key.lower() in _PASSWORD_PARAMS)
    return f"{name}={MASK}" if secret else param


# (besides secret-named ones: `key` is how Google-style APIs take theirs, `sig` a signed URL's signature)
_PASSWORD_PARAMS = frozenset({"pass", "pw", "passwd", "password", "auth", "credentials", "key", "sig", "signature"})


# -- logging -----------------------------------------------------------------------------------------

# Fields every call's lines carry that cannot hold a secret: ids we mint, and what the processors before
# redaction added.
_GENERATED = frozenset(("timestamp", "level"))
_IDS = frozenset(("call_id", "trace_id", "span_id"))
# A hex id, or a call id: its queue's hash tag, a dot and hex ("{tools}.9f2c..."); the tag is scanned.
_ID = re.compile(r"(\{[^{}]*\}\.)?[0-9a-f]{8,64}")
_SHORT = 256  # strings up to this long are scanned once per distinct value (messages, tool names, states)


@lru_cache(maxsize=4096)
def _redact_short(text: str) -> str:
    return redact_text(text)


def redact_event(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> Mapping[str, Any]:
    """``RedactProcessor`` made cheap for the lines every call writes: stamps and hex ids are not scanned,
    and a short string's scan is remembered. With ``workers.shortcuts_off: [redaction]``,
    ``RedactProcessor`` over the whole event instead."""
    if not shortcut_on("redaction"):
        return redact_processor(logger, method_name, event_dict)
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


def utc_text(t: float) -> str:
    """``t`` in ISO 8601, UTC, with microseconds, as ``TimeStamper(fmt="iso", utc=True)`` writes it and RQ
    keeps its times (``broker.calls.rq_time``): the date and time of day formatted once a second."""
    global _second
    whole = int(t)
    second, text = _second
    if whole != second:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
        _second = (whole, text)  # (one tuple: threads read a consistent pair)
    return f"{text}.{int((t - whole) * 1e6):06d}Z"


_second = (-1, "")


def stamp(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """``timestamp``: now, as ``utc_text`` writes it."""
    event_dict["timestamp"] = utc_text(time.time())
    return event_dict


class ConsoleLines:
    """structlog renderer: ``<time> [<level>] <event> key=value ...`` and the traceback under it, the
    layout of structlog's ``ConsoleRenderer(colors=False)`` at a fraction of its cost."""

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
    """Whether an info line would be written (a filtered-out ``log.info`` still builds a bound logger)."""
    return _level <= logging.INFO


_calls: Any = None  # the logger of every call's lines, made by configure()


def call_log() -> Any:
    """The logger of the lines every call writes, bound once per configure() (``structlog.get_logger()``
    assembles a new bound logger on every line: ``cache_logger_on_first_use`` is off)."""
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
    _level = lvl = getattr(logging, str(level).upper(), logging.INFO)
    _json = fmt == "json"
    stream = stream or sys.stderr
    _batched = BatchedLines(stream) if batched else None
    renderer: Any = structlog.processors.JSONRenderer() if fmt == "json" else ConsoleLines()
    # Every logger writes through one writer (one write() per line: the processes of a pool share stderr).
    writer: Any = _batched if _batched is not None else structlog.WriteLogger(stream)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars, structlog.processors.add_log_level, stamp,
            # After format_exc_info, so a traceback's text is scrubbed too.
            structlog.processors.format_exc_info, redact_event, renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=lambda *_args: writer,
        cache_logger_on_first_use=False,
    )
    _calls = structlog.get_logger("hermes.worker").bind()
    # Records of stdlib loggers (plugins, libraries) come out in the same format: JSON lines in JSON mode.
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "hermes_handler", False)]:
        root.removeHandler(old)  # configure() again (another level or format) replaces our handler
    if not root.handlers:
        handler = logging.StreamHandler(stream)
        handler.hermes_handler = True  # type: ignore[attr-defined]
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, redact_event, renderer],
                foreign_pre_chain=[
                    structlog.stdlib.add_logger_name, structlog.processors.add_log_level, stamp,
                    _record_extras,
                ],
            )
        )
        # Our loggers and plugins' follow the configured level; libraries' stay at WARNING, one line each.
        handler.addFilter(_quiet_libraries)
        handler.addFilter(LibraryRecords())
        root.addHandler(handler)
        root.setLevel(lvl)
    for each in root.handlers:
        if not any(isinstance(f, RedactFilter) for f in each.filters):
            each.addFilter(RedactFilter())


class BatchedLines:
    """A worker's log lines written a batch at a time by a thread of their own, each write whole lines of
    at most ``PIPE_BUF`` bytes (never cut by another process's on the shared stderr), so that call threads
    do not give up the interpreter lock for a system call per line. Lines at WARNING and above go out at
    once, and so does a line after ``EVERY`` seconds without one; the rest within ``EVERY`` seconds."""

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
            chunk = ""
            try:
                for line in lines:
                    if chunk and len(chunk) + len(line) + 1 > self.CHUNK:
                        self._stream.write(chunk)
                        chunk = ""
                    chunk += line + "\n"
                self._stream.write(chunk)
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
    """redis-py's records as one line at WARNING at most, the exception named in the message and its
    traceback dropped (unless DEBUG): a failover makes redis-py log what the gateway retries itself."""

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
    WARNING. Where the root logger has a handler, that handler decides alone."""

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


def _quiet_libraries(record: logging.LogRecord) -> bool:
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
