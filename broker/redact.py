"""Redaction: secrets never reach logs, events or the audit log.

Two ways a secret is recognised: by the key it sits under (``password``, ``github_token``, ...) and by
its shape inside any string (bearer tokens, JWTs, PEM private keys, well-known API key prefixes,
passwords in URLs, ``key=value`` pairs in free text). Arguments a tool declares ``sensitive`` are
replaced by a hash of their value instead, so a replay can check it was given the same value.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, MutableMapping
from functools import lru_cache
from typing import Any

from .codec import pack

MASK = "***"
HASH_PREFIX = "sha256:"
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

# Secret shapes inside strings. Each alternative is a named group; ``_replace`` decides what to keep.
# Case-insensitive parts say so with ``(?i:...)``: key prefixes such as ``AKIA`` are case-sensitive.
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
    ("tg", r"\b\d{8,10}:AA[A-Za-z0-9_\-]{30,}"),  # Telegram bot token
    # key=value / "key": "value" in free text (query strings, config dumps, exception messages), also
    # JSON quoted inside JSON text (a back end's error quoting a request: {\"password\":\"...\"}).
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
    if kind == "scheme":
        return (
            m.group(0)
            if _is_prose(m.group("scheme_name"), m.group("scheme_val"))
            else m.group("scheme_head") + MASK
        )
    if kind == "kv":
        if _NOT_SECRET_KEY.search(m.group("kv_head")):
            return m.group(0)
        return m.group("kv_head") + MASK
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


def hash_value(value: Any) -> str:
    """``sha256:<hex>`` of a value's canonical msgpack form: the same value always hashes the same."""
    return HASH_PREFIX + hashlib.sha256(pack(_canonical(value))).hexdigest()


def verify_hash(value: Any, digest: str) -> bool:
    """True when ``value`` is the value that produced ``digest`` (replay checks supplied secrets)."""
    return hash_value(value) == digest


def sensitive_hashes(args: Mapping[str, Any] | None, sensitive_fields: Iterable[str]) -> dict[str, str]:
    """``{field: sha256:...}`` for each sensitive top-level argument present in ``args``."""
    if not args:
        return {}
    return {f: hash_value(args[f]) for f in sensitive_fields if f in args}


def redact(value: Any, sensitive_fields: Iterable[str] = (), max_text: int | None = None) -> Any:
    """A redacted copy of ``value``; top-level keys in ``sensitive_fields`` become their hash.

    ``max_text``: a longer string keeps its first ``max_text`` characters and says how many more there
    were. Scanning text for secrets costs about a quarter of a microsecond a character, holding the GIL,
    so a record of a call with megabytes of arguments must not scan them all.
    """
    if type(value) in _SCALARS:
        return value
    fields = frozenset(sensitive_fields)
    if fields and isinstance(value, Mapping):
        return {
            k: hash_value(v)
            if k in fields
            else (_mask_keyed(v) if _key_is_secret(k) else _redact(v, 1, max_text))
            for k, v in value.items()
        }
    return _redact(value, 0, max_text)


def clip_text(text: str, limit: int) -> str:
    """The first ``limit`` characters of ``text``, redacted, and how many more there were.

    The scan reaches past the cut, so a secret straddling it is masked, not shown in part.
    """
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
    from urllib.parse import unquote_plus

    name, eq, value = param.partition("=")
    key = unquote_plus(name)
    secret = eq and value and (is_secret_key(key) or key.lower() in _PASSWORD_PARAMS)
    return f"{name}={MASK}" if secret else param


_PASSWORD_PARAMS = frozenset({"pass", "pw", "passwd", "password", "auth", "credentials"})
