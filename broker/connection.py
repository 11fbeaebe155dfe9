"""Connecting to the broker: ``HERMES_REDIS_URL`` or the embedded one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

import redis
import redis.cluster
from redis.sentinel import MasterNotFoundError, SentinelManagedConnection

from .embedded import EmbeddedBroker
from .errors import BrokerUnavailable, ConfigError

URL_ENV = "HERMES_REDIS_URL"
SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
# How long a Sentinel may take to answer "where is the primary" (an unreachable one is skipped after it).
SENTINEL_TIMEOUT = 2.0


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


CLUSTER_SCHEME = "redis+cluster://"


def is_cluster(conn: Any) -> bool:
    """Whether ``conn`` is a Redis Cluster client (sync or asyncio)."""
    import redis.asyncio.cluster

    return isinstance(conn, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """The seed nodes and credentials of ``redis+cluster://[user:pass@]host:port[,host:port...]``."""
    from urllib.parse import unquote

    rest = url[len(CLUSTER_SCHEME) :].split("/", 1)[0].split("?", 1)[0]
    creds: dict[str, str] = {}
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        if user:
            creds["username"] = unquote(user)
        if password:
            creds["password"] = unquote(password)
    nodes = []
    for part in rest.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a cluster seed node is host:port, not {part!r}")
        nodes.append((host.strip("[]"), int(port)))
    return nodes, creds


def cluster_from_url(url: str, **kwargs: Any) -> Any:
    """A ``RedisCluster`` client on the seed nodes of a ``redis+cluster://`` URL, checked with PING."""
    from redis.cluster import ClusterNode, RedisCluster

    nodes, creds = cluster_nodes(url)
    options: dict[str, Any] = {**creds, **kwargs}
    conn = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], health_check_interval=30, **options)
    conn.ping()
    return conn


async def async_from_url(url: str, **kwargs: Any) -> Any:
    """An asyncio client for the same URLs as :func:`from_url` (``redis.asyncio``; its cluster client for
    ``redis+cluster://``, a Sentinel-managed one for ``redis+sentinel://``), checked with PING;
    BrokerUnavailable naming the URL (passwords masked) when it does not answer."""
    import redis.asyncio
    import redis.asyncio.cluster

    conn: Any = None
    try:
        if url.startswith(CLUSTER_SCHEME):
            nodes, creds = cluster_nodes(url)
            options: dict[str, Any] = {**creds, **kwargs}
            conn = redis.asyncio.cluster.RedisCluster(
                startup_nodes=[redis.asyncio.cluster.ClusterNode(h, p) for h, p in nodes], **options
            )
        elif url.startswith(SENTINEL_SCHEME + "://"):
            conn = sentinel_client(url, is_async=True, **kwargs)
        else:
            conn = redis.asyncio.Redis.from_url(url, **kwargs)
        await conn.ping()
    except MasterNotFoundError as e:
        await _close(conn)
        raise BrokerUnavailable(f"no primary at {redact_url(url)}: {sentinels_say(url)}") from e
    except redis.AuthenticationError as e:  # (a ConnectionError: caught before those)
        await _close(conn)
        raise BrokerUnavailable(f"Redis at {redact_url(url)} refused the credentials: {e}") from e
    except (redis.RedisError, OSError, ValueError) as e:
        await _close(conn)
        raise BrokerUnavailable(f"cannot reach Redis at {redact_url(url)}: {e}") from e
    return conn


async def _close(conn: Any) -> None:
    if conn is not None:
        await conn.aclose()


def from_url(url: str, **kwargs: Any) -> redis.Redis:
    """A client for redis://, rediss://, unix:// (password in the URL), redis+sentinel:// URLs, or a Redis
    Cluster for ``redis+cluster://host:port[,host:port...]``, checked with PING."""
    try:
        if url.startswith(CLUSTER_SCHEME):
            return cluster_from_url(url, **kwargs)  # type: ignore[no-any-return]
        if url.startswith(SENTINEL_SCHEME + "://"):
            conn = sentinel_client(url, **kwargs)
        else:
            conn = redis.Redis.from_url(url, health_check_interval=30, **kwargs)  # type: ignore[arg-type]
        conn.ping()
    except MasterNotFoundError as e:
        raise BrokerUnavailable(f"no primary at {redact_url(url)}: {sentinels_say(url)}") from e
    except redis.AuthenticationError as e:  # (a ConnectionError: caught before those)
        raise BrokerUnavailable(f"Redis at {redact_url(url)} refused the credentials: {e}") from e
    except (
        redis.ConnectionError,
        redis.TimeoutError,
        redis.exceptions.RedisClusterException,
        ValueError,
    ) as e:
        raise BrokerUnavailable(f"cannot reach Redis at {redact_url(url)}: {e}") from e
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

    if is_cluster(conn):  # (subscribe confirmations are kept: a client waits for its sharded ones)
        return conn.pubsub(**kwargs)
    is_async = isinstance(conn, redis.asyncio.Redis)
    default = redis.asyncio.connection.DefaultParser if is_async else redis.connection.DefaultParser
    parser = conn.connection_pool.connection_kwargs.get("parser_class") or default
    from . import pipes

    if pipes.FAST and hasattr(parser, "set_pubsub_push_handler"):  # (the pure-Python RESP2 parser takes none)
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



# -- Sentinel ------------------------------------------------------------------------------------


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
    segments = [unquote(s) for s in path.split("/")] if path else []
    if segments and segments[-1] == "":
        segments.pop()
    if not segments or not segments[0]:
        raise bad("no master name: expected redis+sentinel://host:port[,host:port...]/<master-name>[/db]")
    if len(segments) > 2:
        raise bad("expected /<master-name>[/db] after the Sentinels")
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise bad(f"database {segments[1]!r} is not a number")
        db = int(segments[1])
    options = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    unknown = sorted(set(options) - {"sentinel_password", "sentinel_username"})
    if unknown:
        raise bad(f"unknown option(s) {', '.join(unknown)}; known: sentinel_password, sentinel_username")
    return SentinelURL(
        tuple(sentinels),
        segments[0],
        db,
        username,
        password,
        options.get("sentinel_username") or None,
        options.get("sentinel_password") or None,
    )


def _sentinel_kwargs(parsed: SentinelURL) -> dict[str, Any]:
    out: dict[str, Any] = {"socket_connect_timeout": SENTINEL_TIMEOUT, "socket_timeout": SENTINEL_TIMEOUT}
    if parsed.sentinel_password is not None:
        out["password"] = parsed.sentinel_password
    if parsed.sentinel_username is not None:
        out["username"] = parsed.sentinel_username
    return out


def sentinels_say(url: str) -> str:
    """What each Sentinel of ``url`` answers about its primary, in one line (why no primary was found)."""
    parsed = parse_sentinel_url(url)
    said = []
    for host, port in parsed.sentinels:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        client = redis.Redis(host, port, **_sentinel_kwargs(parsed))
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

    redis-py resolves the primary in ``connect()``, but a connection that broke is connected again by
    ``send_packed_command`` through ``connect_check_health``, which reuses the old address: a connection
    kept across a failover (a worker's outbox, a subscription) would knock on the dead primary forever.
    """

    _resolving = False

    def connect_to(self, address: Any) -> None:
        self._resolving = True  # the address was just asked for
        try:
            super().connect_to(address)
        finally:
            self._resolving = False

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._sock is None and not self._resolving and self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)


def _async_following_connection() -> type:
    """The asyncio twin of :class:`_FollowingConnection` (made on first use: redis.asyncio loads lazily)."""
    global _ASYNC_FOLLOWING
    if _ASYNC_FOLLOWING is None:
        from redis.asyncio.sentinel import SentinelManagedConnection as AsyncManaged

        class AsyncFollowing(AsyncManaged):  # type: ignore[misc]
            _resolving = False

            async def connect_to(self, address: Any) -> None:
                self._resolving = True
                try:
                    await super().connect_to(address)
                finally:
                    self._resolving = False

            async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
                if not self.is_connected and not self._resolving and self.connection_pool.is_master:
                    self.host, self.port = await self.connection_pool.get_master_address()
                await super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)

        _ASYNC_FOLLOWING = AsyncFollowing
    return _ASYNC_FOLLOWING


_ASYNC_FOLLOWING: type | None = None


def sentinel_client(url: str, *, is_async: bool = False, **kwargs: Any) -> Any:
    """A client of the primary the Sentinels of ``url`` name (redis-py's ``Sentinel.master_for``): its
    pool asks them again on every new connection, so it follows a promoted replica by itself."""
    parsed = parse_sentinel_url(url)
    sentinel_kwargs = _sentinel_kwargs(parsed)
    options: dict[str, Any] = {"db": parsed.db, "username": parsed.username, "password": parsed.password}
    if is_async:
        options["connection_class"] = _async_following_connection()
    else:
        options["health_check_interval"] = 30
        options["connection_class"] = _FollowingConnection
    options.update(kwargs)
    if is_async:
        from redis.asyncio.sentinel import Sentinel as AsyncSentinel

        return AsyncSentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs).master_for(
            parsed.master, **options
        )
    from redis.sentinel import Sentinel

    return Sentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs).master_for(parsed.master, **options)
