"""Connecting to the broker: a URL (``HERMES_REDIS_URL`` / ``broker.url``: plain, ``redis+cluster://``,
``redis+sentinel://``: ``broker.sentinel``) or the embedded one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
import redis.cluster
from redis.sentinel import MasterNotFoundError

from broker.logs import redact_url

from .config import REDIS_URL_ENV
from .embedded import EmbeddedBroker
from .errors import BrokerFull, BrokerUnavailable, HermesError
from .logs import library_logs
from .sentinel import SENTINEL_SCHEME, sentinel_client, sentinels_say

URL_ENV = REDIS_URL_ENV  # (named in messages; Settings reads it: ``settings.broker.url``)


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


@contextmanager
def answered(what: str) -> Iterator[None]:
    """A Redis error while doing ``what`` becomes ``BrokerUnavailable`` (``BrokerFull`` at maxmemory)."""
    try:
        yield
    except redis.RedisError as e:
        raise broker_error(what, e) from e


def broker_error(what: str, error: Exception) -> HermesError:
    """The typed error for a Redis error met while doing ``what``."""
    if isinstance(error, redis.exceptions.OutOfMemoryError):
        return BrokerFull(f"{what}: {out_of_memory(error)}")
    return BrokerUnavailable(f"{what}: the broker did not answer: {error}")


def out_of_memory(error: Exception) -> str:
    """What ``BrokerFull`` says."""
    return (
        f"Redis is out of memory: maxmemory reached ({error}); new calls are refused until ended calls "
        "free theirs (workers.result_ttl) or maxmemory is raised"
    )


CLUSTER_SCHEME = "redis+cluster://"


def is_cluster(conn: Any) -> bool:
    """Whether ``conn`` is a Redis Cluster client (sync or asyncio)."""
    import redis.asyncio.cluster

    return isinstance(conn, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


def _seeded_cluster(module: Any, url: str, **kwargs: Any) -> Any:
    """The client of ``redis+cluster://[user:pass@]host:port[,host:port...]``, from ``redis.cluster`` or
    ``redis.asyncio.cluster``."""
    rest, _, query = url[len(CLUSTER_SCHEME) :].partition("?")
    rest, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):  # taken silently, it would name a database the cluster has not
        raise ValueError(f"a cluster has only database 0: drop /{path.strip('/')} from the URL")
    if query:
        raise ValueError(f"a {CLUSTER_SCHEME} URL takes no ?options (got ?{query.split('=', 1)[0]}=...)")
    creds: dict[str, str] = {}
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        if user:
            creds["username"] = unquote(user)
        if password:
            creds["password"] = unquote(password)
    seeds = []
    for part in rest.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a cluster seed node is host:port, not {part!r}")
        seeds.append(module.ClusterNode(host.strip("[]"), int(port)))
    return module.RedisCluster(startup_nodes=seeds, **{**creds, **kwargs})


def cluster_node_url(url: str, info: dict[str, Any]) -> bool:
    """Whether a plain URL reached a Redis Cluster node (its ``INFO cluster``), then used as the cluster's
    seed; BrokerUnavailable when the URL names a database other than 0."""
    if str(info.get("cluster_enabled", 0)) != "1":
        return False
    db = redis.connection.parse_url(url).get("db") if url.startswith(("redis://", "rediss://")) else None
    if not db:
        return True
    raise BrokerUnavailable(
        f"{redact_url(url)} is a Redis Cluster node, and a cluster has only database 0: drop /{db} from the "
        f"URL (or name the cluster as {CLUSTER_SCHEME}host:port[,host:port...])"
    )


# An asyncio client's connections to a plain Redis: redis-py's pool refuses the 101st at once ("Too many
# connections") while a blocking pool makes it wait for one, so thousands of calls gathered at once are
# sent ~100 at a time instead of failing with BrokerUnavailable.
ASYNC_CONNECTIONS = 100
ASYNC_CONNECTION_WAIT = 30.0  # seconds a command waits for a free connection before it fails


async def async_from_url(url: str, **kwargs: Any) -> Any:
    """An asyncio client for the same URLs as :func:`from_url`, checked the same way."""
    import redis.asyncio
    import redis.asyncio.cluster

    library_logs()
    conn: Any = None
    try:
        if url.startswith(CLUSTER_SCHEME):
            conn = _seeded_cluster(redis.asyncio.cluster, url, **kwargs)
        elif url.startswith(SENTINEL_SCHEME + "://"):
            conn = sentinel_client(url, is_async=True, **kwargs)
        else:
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                url, max_connections=ASYNC_CONNECTIONS, timeout=ASYNC_CONNECTION_WAIT, **kwargs
            )
            conn = redis.asyncio.Redis(connection_pool=pool)
            conn.auto_close_connection_pool = True  # (aclose() closes the pool, as from_url's client does)
            if not cluster_node_url(url, await _info_cluster(conn)):
                return conn  # (INFO answered: no PING needed after it)
            await _close(conn)
            conn = redis.asyncio.cluster.RedisCluster.from_url(url, **kwargs)
        await conn.ping()
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError, ValueError) as e:
        await _close(conn)
        raise _unreachable(url, e) from e
    return conn


def _unreachable(url: str, error: Exception) -> BrokerUnavailable:
    """Why no client of ``url`` could be had (passwords masked)."""
    if isinstance(error, MasterNotFoundError):
        return BrokerUnavailable(f"no primary at {redact_url(url)}: {sentinels_say(url)}")
    if isinstance(error, redis.AuthenticationError):
        return BrokerUnavailable(f"Redis at {redact_url(url)} refused the credentials: {error}")
    if "Cluster mode is not enabled" in str(error):  # (redis-py's words for a seed that is a single Redis)
        return BrokerUnavailable(
            f"{redact_url(url)} names no Redis Cluster: cluster mode is not enabled on its node(s); "
            "name a single Redis as redis://host:port"
        )
    if url.partition("://")[0].lower() not in URL_SCHEMES:  # (redis-py's own message leaves ours out)
        return BrokerUnavailable(
            f"{redact_url(url)} is not a Redis URL (one starts with {', '.join(s + '://' for s in URL_SCHEMES)})"
        )
    return BrokerUnavailable(f"cannot reach Redis at {redact_url(url)}: {error}")


URL_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "redis+sentinel")


async def _close(conn: Any) -> None:
    if conn is not None:
        await conn.aclose()


async def _info_cluster(conn: Any) -> dict[str, Any]:
    try:
        return await conn.info("cluster")  # type: ignore[no-any-return]
    except redis.ResponseError as e:
        return _refused(e)


def _info_cluster_sync(conn: redis.Redis) -> dict[str, Any]:
    try:
        return conn.info("cluster")  # type: ignore[return-value]
    except redis.ResponseError as e:
        return _refused(e)


def _refused(e: redis.ResponseError) -> dict[str, Any]:
    """A cluster node refuses the SELECT of a URL's database; INFO refused otherwise (a managed Redis) is
    taken as no cluster."""
    return {"cluster_enabled": 1} if "not allowed in cluster mode" in str(e) else {}


def from_url(url: str, **kwargs: Any) -> redis.Redis:
    """A client for redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://host:port[,...] URLs
    (a plain URL naming a cluster node gives a cluster client), checked with PING (or ``INFO cluster``)."""
    library_logs()
    try:
        if url.startswith(CLUSTER_SCHEME):
            conn: Any = _seeded_cluster(redis.cluster, url, health_check_interval=30, **kwargs)
        elif url.startswith(SENTINEL_SCHEME + "://"):
            conn = sentinel_client(url, **kwargs)
        else:
            conn = redis.Redis.from_url(url, health_check_interval=30, **kwargs)  # type: ignore[arg-type]
            if not cluster_node_url(url, _info_cluster_sync(conn)):
                return conn  # (INFO answered: no PING needed after it)
            conn.close()
            conn = redis.cluster.RedisCluster.from_url(url, health_check_interval=30, **kwargs)
        conn.ping()
    except (
        redis.ConnectionError, redis.TimeoutError, redis.exceptions.RedisClusterException, ValueError
    ) as e:
        raise _unreachable(url, e) from e
    return conn


def _as_is(message: Any) -> Any:
    return message


async def _as_is_async(message: Any) -> Any:
    return message


def subscriber(conn: Any, **kwargs: Any) -> Any:
    """``conn.pubsub(ignore_subscribe_messages=True)`` that hands RESP3 push messages on as they are
    (redis-py's default handler formats each into a debug string, logged or not; sync or asyncio)."""
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
    """Connect to ``url`` (``settings.broker.url``), else start the embedded broker."""
    if url:
        return BrokerHandle(from_url(url), url, f"Redis at {redact_url(url)}")
    if not embedded_ok:
        raise BrokerUnavailable(f"{URL_ENV} is not set and the embedded broker is not allowed here")
    emb = EmbeddedBroker().start()
    return BrokerHandle(from_url(emb.url), emb.url, emb.describe(), emb)
