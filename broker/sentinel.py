"""Redis Sentinel: ``redis+sentinel://`` URLs, what the Sentinels say, and clients that follow the primary."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

from broker.logs import redact_url

from .errors import ConfigError

SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
# How long a Sentinel may take to answer "where is the primary" (an unreachable one is skipped after it).
SENTINEL_TIMEOUT = 2.0


@dataclass(frozen=True)
class SentinelURL:
    """``redis+sentinel://[user:pass@]host:port[,host:port...]/<master>[/db][?sentinel_password=...]``.

    ``user:pass`` authenticate to the primary (and its replicas); ``sentinel_password`` (and
    ``sentinel_username``) to the Sentinels themselves. A host without a port is on 26379.
    """

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


def parse_sentinel_url(url: str) -> SentinelURL:
    """Read a ``redis+sentinel://`` URL; a ConfigError naming the (masked) URL says what is wrong."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"broker URL {redact_url(url)}: {why}")

    prefix = SENTINEL_SCHEME + "://"
    if not url.startswith(prefix):
        raise bad(f"not a {prefix} URL")
    rest, _, query = url[len(prefix) :].partition("?")
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        creds, netloc = netloc.rsplit("@", 1)
        user, has_pw, pw = creds.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if has_pw else None
    sentinels = []
    for part in netloc.split(","):
        part = part.strip()
        if not part:
            raise bad("expected host:port[,host:port...] of the Sentinels before /<master-name>")
        if part.startswith("["):  # [IPv6]:port
            host, _, port_text = part[1:].partition("]")
            port_text = port_text.removeprefix(":")
        else:
            host, _, port_text = part.rpartition(":") if ":" in part else (part, "", "")
        try:
            port = int(port_text) if port_text else SENTINEL_PORT
        except ValueError:
            raise bad(f"Sentinel {part!r}: the port is not a number") from None
        if not host or not 0 < port < 65536:
            raise bad(f"Sentinel {part!r}: expected host:port")
        sentinels.append((host, port))
    segments = [unquote(s) for s in path.removesuffix("/").split("/")]
    if not segments[0]:
        raise bad("no master name: expected redis+sentinel://host:port[,host:port...]/<master-name>[/db]")
    if len(segments) > 2:
        raise bad("expected /<master-name>[/db] after the Sentinels")
    if len(segments) == 2 and not segments[1].isdigit():
        raise bad(f"database {segments[1]!r} is not a number")
    db = int(segments[1]) if len(segments) == 2 else 0
    options = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    unknown = sorted(set(options) - {"sentinel_password", "sentinel_username"})
    if unknown:
        raise bad(f"unknown option(s) {', '.join(unknown)}; known: sentinel_password, sentinel_username")
    sentinel_auth = (options.get("sentinel_username") or None, options.get("sentinel_password") or None)
    return SentinelURL(tuple(sentinels), segments[0], db, username, password, *sentinel_auth)


def _sentinel_kwargs(parsed: SentinelURL) -> dict[str, Any]:
    timeouts = {"socket_connect_timeout": SENTINEL_TIMEOUT, "socket_timeout": SENTINEL_TIMEOUT}
    return {**timeouts, "password": parsed.sentinel_password, "username": parsed.sentinel_username}


def sentinels_say(url: str) -> str:
    """What each Sentinel of ``url`` answers about its primary, in one line (why no primary was found)."""
    parsed = parse_sentinel_url(url)
    said = []
    for host, port in parsed.sentinels:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # One try each: redis-py's default retry backs off for seconds while a user waits for this line.
        client = redis.Redis(host, port, retry=Retry(NoBackoff(), 0), **_sentinel_kwargs(parsed))
        try:
            masters: dict[str, Any] = client.sentinel_masters()  # type: ignore[assignment]
        except redis.RedisError as e:
            said.append(f"{where} did not answer ({type(e).__name__}: {e})")
            continue
        finally:
            client.close()
        state = masters.get(parsed.master)
        if state is None:
            watched = ", ".join(sorted(masters)) or "none"
            said.append(f"{where} watches no primary named {parsed.master!r} (it watches: {watched})")
        else:
            flags = ",".join(k for k in ("is_sdown", "is_odown", "is_disconnected") if state.get(k)) or "not a master"
            said.append(f"{where} names {state.get('ip')}:{state.get('port')} but it is down ({flags})")
    return "; ".join(said)


class _FollowingConnection(SentinelManagedConnection):
    """A Sentinel-managed connection that asks where the primary is on *every* reconnect.

    redis-py reconnects a broken connection through ``connect_check_health`` at its old address, so one
    kept across a failover would knock on the dead primary forever. These are redis-py's insides: redis is
    pinned to the range ``tests/broker/test_sentinel_internals.py`` checks them on.
    """

    _resolving = False

    def connect_to(self, address: Any) -> None:
        self._resolving = True  # the address was just asked for
        try:
            super().connect_to(address)
        finally:
            self._resolving = False

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if not self.is_connected and not self._resolving and self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)


@functools.cache
def _async_following_connection() -> type:
    """The asyncio twin of :class:`_FollowingConnection` (made on first use: redis.asyncio loads lazily)."""
    from redis.asyncio.sentinel import SentinelManagedConnection as AsyncManaged

    class AsyncFollowing(AsyncManaged):  # type: ignore[misc]
        _resolving = False

        async def connect_to(self, address: Any) -> None:
            self._resolving = True
            try:
                await super().connect_to(address)
            finally:
                self._resolving = False

        async def connect_check_health(
            self, check_health: bool = True, retry_socket_connect: bool = True
        ) -> None:
            if not self.is_connected and not self._resolving and self.connection_pool.is_master:
                self.host, self.port = await self.connection_pool.get_master_address()
            await super().connect_check_health(
                check_health=check_health, retry_socket_connect=retry_socket_connect
            )

    return AsyncFollowing


def sentinel_client(url: str, *, is_async: bool = False, **kwargs: Any) -> Any:
    """A client of the primary the Sentinels of ``url`` name (redis-py's ``Sentinel.master_for``): its
    pool asks them again on every new connection, so it follows a promoted replica by itself."""
    parsed = parse_sentinel_url(url)
    options: dict[str, Any] = {"db": parsed.db, "username": parsed.username, "password": parsed.password}
    sentinel: Any = Sentinel
    if is_async:
        from redis.asyncio.sentinel import Sentinel as AsyncSentinel

        sentinel = AsyncSentinel
        options["connection_class"] = _async_following_connection()
        # (its pool refuses a connection past max_connections at once, and has no blocking kind: an asyncio
        # client's gathered calls each hold one while they are sent)
        options["max_connections"] = 1000
    else:
        options.update(health_check_interval=30, connection_class=_FollowingConnection)
    options.update(kwargs)
    sentinels = sentinel(list(parsed.sentinels), sentinel_kwargs=_sentinel_kwargs(parsed))
    return sentinels.master_for(parsed.master, **options)
