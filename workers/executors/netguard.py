"""The SSRF guard for outgoing tool traffic, an httpcore network backend under an httpx transport.

Every new connection (each redirect hop too) resolves the host itself, refuses it if ANY address is not
public or is a cloud metadata address, and connects to the address it checked (no DNS rebinding). Its
streams also watch the call's cancellation while waiting for bytes.
"""

from __future__ import annotations

import contextvars
import ipaddress
import select
import socket
import ssl
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

from broker.errors import CallCancelled, DestinationBlocked, InvalidSpec

from . import POLL, ExecContext

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud metadata endpoints: refused even when an allow-list would otherwise admit them.
METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254", "192.0.0.192")
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

# The call whose request is being sent on this thread (httpcore's sync pool does I/O in the caller).
current_call: contextvars.ContextVar[ExecContext | None] = contextvars.ContextVar(
    "current_call", default=None
)


def resolve_host(host: str, port: int) -> list[str]:
    """All addresses ``host`` resolves to (tests replace this to simulate hostile DNS)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class GuardPolicy:
    """What the guard admits: public addresses, plus explicitly allowed hosts and networks."""

    enabled: bool = True
    allow_hosts: frozenset[str] = frozenset()
    allow_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def build(cls, enabled: bool, hosts: Iterable[str], networks: Iterable[str]) -> GuardPolicy:
        try:
            nets = tuple(ipaddress.ip_network(str(n), strict=False) for n in networks)
        except ValueError as e:
            raise InvalidSpec(f"http: allow_networks: {e}") from e
        return cls(bool(enabled), frozenset(str(h).lower().strip("[]") for h in hosts), nets)

    def host_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == p or (p.startswith("*.") and host.endswith(p[1:])) for p in self.allow_hosts)

    def refusal(self, host: str, address: str) -> str | None:
        """Why ``address`` (resolved from ``host``) may not be reached, or None if it may."""
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return f"{address!r} is not an IP address"
        for candidate in _embedded(ip):
            if candidate in METADATA:
                return f"{candidate} is a cloud metadata address"
        if not self.enabled or self.host_allowed(host):
            return None
        if any(ip in net for net in self.allow_networks if net.version == ip.version):
            return None
        for candidate in _embedded(ip):
            if not candidate.is_global or candidate.is_multicast:
                return (
                    f"{candidate} is not a public address ({_kind(candidate)}); to reach an internal "
                    "service, allow it in config.yaml: executors.http.allow_networks: "
                    f"[\"{candidate}/{candidate.max_prefixlen}\"] or allow_hosts: [\"{host}\"]"
                )
        return None


def _embedded(ip: IPAddress) -> list[IPAddress]:
    """The address plus any IPv4 address hidden inside it (mapped, 6to4, Teredo, NAT64)."""
    out: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped:
            out.append(ip.ipv4_mapped)
        if ip.sixtofour:
            out.append(ip.sixtofour)
        if ip.teredo:
            out.extend(ip.teredo)
        if ip in _NAT64:
            out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


def _kind(ip: IPAddress) -> str:
    for name in ("loopback", "link_local", "private", "multicast", "reserved", "unspecified"):
        if getattr(ip, f"is_{name}"):
            return name.replace("_", "-")
    return "non-global"


class GuardedBackend(httpcore.NetworkBackend):
    """httpcore network backend that checks and pins every address before connecting."""

    def __init__(self, policy: GuardPolicy) -> None:
        self.policy = policy

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        bare = host.strip("[]")
        try:
            addresses = resolve_host(bare, port)
        except (socket.gaierror, UnicodeError) as e:
            raise httpcore.ConnectError(f"cannot resolve {bare!r}: {e}") from e
        if not addresses:
            raise httpcore.ConnectError(f"{bare!r} resolves to no address")
        for address in addresses:
            if reason := self.policy.refusal(bare, address):
                raise DestinationBlocked(
                    f"refusing to connect to {bare!r}: {reason}", host=bare, address=address
                )
        last: Exception | None = None
        for address in addresses:
            try:
                # httpcore's own backend, given the address just checked (a literal IP: nothing to resolve)
                stream = _STOCK.connect_tcp(address, port, timeout, local_address, socket_options)
            except httpcore.ConnectTimeout as e:
                raise httpcore.ConnectTimeout(f"connecting to {bare}:{port} timed out") from e
            except httpcore.ConnectError as e:
                last = e
                continue
            return WatchedStream(stream, stream.get_extra_info("socket"))
        raise httpcore.ConnectError(f"cannot connect to {bare}:{port}: {last}")

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> Any:
        raise DestinationBlocked("unix sockets are not reachable from the http executor")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


_STOCK = httpcore.SyncBackend()


class WatchedStream(httpcore.NetworkStream):
    """A stream whose reads notice the current call's cancellation while the server is silent."""

    def __init__(self, inner: httpcore.NetworkStream, sock: socket.socket) -> None:
        self._inner = inner
        self._sock = sock

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if (ctx := current_call.get()) is not None:
            self._wait_readable(ctx, timeout)
        return self._inner.read(max_bytes, timeout)

    def _wait_readable(self, ctx: ExecContext, timeout: float | None) -> None:
        # Bounded by the call's deadline as well as by the read's timeout: the timeout is per read, so a
        # server that sends a byte every little while (a header line every 0.5 s) ran on past the tool's.
        end = ctx.deadline if timeout is None else min(ctx.deadline, time.monotonic() + timeout)
        while True:
            if ctx.cancelled.is_set():
                raise CallCancelled(f"call {ctx.call_id} was cancelled")
            if time.monotonic() >= end:
                raise httpcore.ReadTimeout("timed out waiting for the server")
            if isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
                return
            readable, _, _ = select.select([self._sock], [], [], max(0.0, min(POLL, end - time.monotonic())))
            if readable:
                return

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, timeout)

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        inner = self._inner.start_tls(ssl_context, server_hostname, timeout)
        return WatchedStream(inner, inner.get_extra_info("socket"))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


# httpx names its errors after httpcore's (as httpx's own transport maps them).
_ERRORS: dict[type[Exception], type[httpx.HTTPError]] = {
    getattr(httpcore, name): getattr(httpx, name)
    for name in (
        "TimeoutException", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout", "NetworkError",
        "ConnectError", "ReadError", "WriteError", "ProxyError", "UnsupportedProtocol", "ProtocolError",
        "LocalProtocolError", "RemoteProtocolError",
    )
}


@contextmanager
def _as_httpx_errors() -> Iterator[None]:
    try:
        yield
    except Exception as e:
        as_httpx = next((_ERRORS[cls] for cls in type(e).__mro__ if cls in _ERRORS), None)
        if as_httpx is None:  # (ours: DestinationBlocked, CallCancelled)
            raise
        raise as_httpx(str(e)) from e


class _Body(httpx.SyncByteStream):
    def __init__(self, stream: Iterable[bytes]) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        with _as_httpx_errors():
            yield from self._stream

    def close(self) -> None:
        if (close := getattr(self._stream, "close", None)) is not None:
            close()


class GuardedTransport(httpx.BaseTransport):
    """An httpx transport on an httpcore connection pool whose network backend is the guard:
    the pool httpx's ``HTTPTransport`` builds but for the backend, and never a proxy (it would connect to
    addresses the guard never saw)."""

    def __init__(self, policy: GuardPolicy, verify: bool) -> None:
        self.pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify, trust_env=False),
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=GuardedBackend(policy),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        sent = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw,
            content=request.stream,  # type: ignore[arg-type]
            extensions=request.extensions,
        )
        with _as_httpx_errors():
            got = self.pool.handle_request(sent)
        return httpx.Response(
            status_code=got.status,
            headers=got.headers,
            stream=_Body(got.stream),  # type: ignore[arg-type]
            extensions=got.extensions,
        )

    def close(self) -> None:
        self.pool.close()
