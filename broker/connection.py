"""Connecting to the broker: ``HERMES_REDIS_URL`` or the embedded one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis

from .embedded import EmbeddedBroker
from .errors import BrokerUnavailable

URL_ENV = "HERMES_REDIS_URL"


@dataclass
class BrokerHandle:
    """A connection plus where it goes (for the CLI to say which broker it uses)."""

    conn: redis.Redis
    url: str
    description: str
    embedded: EmbeddedBroker | None = None

    def close(self) -> None:
        self.conn.close()
        if self.embedded is not None:
            self.embedded.stop()


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

    from .redact import MASK, is_secret_key

    name, eq, value = param.partition("=")
    key = unquote_plus(name)
    secret = eq and value and (is_secret_key(key) or key.lower() in _PASSWORD_PARAMS)
    return f"{name}={MASK}" if secret else param


_PASSWORD_PARAMS = frozenset({"pass", "pw", "passwd", "password", "auth", "credentials"})


@contextmanager
def answered(what: str) -> Iterator[None]:
    """Redis failing (down, restarting, refusing the command) while doing ``what`` is a typed
    ``BrokerUnavailable`` for the caller, not a raw redis error (redis.asyncio raises the same classes)."""
    try:
        yield
    except redis.RedisError as e:
        raise BrokerUnavailable(f"{what}: the broker did not answer: {e}") from e


def from_url(url: str, **kwargs: object) -> redis.Redis:
    """A client for redis://, rediss:// or unix:// URLs (password in the URL), checked with PING."""
    try:
        conn = redis.Redis.from_url(url, health_check_interval=30, **kwargs)  # type: ignore[arg-type]
        conn.ping()
    except (redis.ConnectionError, redis.TimeoutError, ValueError) as e:
        raise BrokerUnavailable(f"cannot reach Redis at {redact_url(url)}: {e}") from e
    except redis.AuthenticationError as e:
        raise BrokerUnavailable(f"Redis at {redact_url(url)} refused the credentials: {e}") from e
    return conn


def _as_is(message: Any) -> Any:
    return message


async def _as_is_async(message: Any) -> Any:
    return message


def subscriber(conn: Any, **kwargs: Any) -> Any:
    """``conn.pubsub(ignore_subscribe_messages=True)`` that hands RESP3 push messages on as they are.

    redis-py's default handler formats every pushed message into a debug string (logged or not): on a
    busy event channel that costs more than handling the event. Works for redis.asyncio clients too.
    """
    import redis.asyncio

    is_async = isinstance(conn, redis.asyncio.Redis)
    default = redis.asyncio.connection.DefaultParser if is_async else redis.connection.DefaultParser
    parser = conn.connection_pool.connection_kwargs.get("parser_class") or default
    if hasattr(parser, "set_pubsub_push_handler"):  # the pure-Python RESP2 parser takes no handler
        kwargs["push_handler_func"] = _as_is_async if is_async else _as_is
    return conn.pubsub(ignore_subscribe_messages=True, **kwargs)


def connect(url: str | None = None, *, embedded_ok: bool = True) -> BrokerHandle:
    """Connect to ``url``, else ``$HERMES_REDIS_URL``, else start the embedded broker."""
    url = url or os.environ.get(URL_ENV) or None
    if url:
        return BrokerHandle(from_url(url), url, f"Redis at {redact_url(url)}")
    if not embedded_ok:
        raise BrokerUnavailable(f"{URL_ENV} is not set and the embedded broker is not allowed here")
    emb = EmbeddedBroker().start()
    return BrokerHandle(from_url(emb.url), emb.url, emb.describe(), emb)
