"""Downloading a client's image or video URL: bounded in time and in where it goes.

A URL in a request makes this server open a connection on the client's behalf, so
every step of it is bounded by one deadline (``--fetch-timeout``): the name
lookup (the system resolver can take tens of seconds and cannot be interrupted,
so it runs aside and is waited for only as long as time remains), the connect,
the headers and the body (a watchdog shuts the socket however slowly the server
trickles). Where it may go: the hosts of ``--allowed-media-domains`` when set
(checked on every connection, redirects included), never a link-local,
multicast or unspecified address or a cloud metadata service's, and redirects
only to http(s). The address checked is the one connected to, so a name that
resolves differently the second time cannot slip past; for the same reason no
proxy is used (a proxy would connect wherever the URL says, unchecked).
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from app.body import io_wait
from app.errors import APIError

FETCH_CHUNK = 1 << 16  # bytes a read asks for: the deadline is checked between reads


@dataclass(frozen=True)
class FetchPolicy:
    timeout: float = 10.0  # seconds for the whole download (--fetch-timeout)
    allowed_domains: tuple[str, ...] = ()  # empty: any host; "*.example.com": its subdomains
    private: bool = False  # loopback and private networks too (--fetch-private-urls)

    def allows(self, host: str) -> bool:
        if not self.allowed_domains:
            return True
        host = host.lower().rstrip(".")
        for domain in self.allowed_domains:
            domain = domain.lower().rstrip(".")
            if domain.startswith("*."):
                if host.endswith(domain[1:]):
                    return True
            elif host == domain:
                return True
        return False


def fetch(url: str, policy: FetchPolicy, max_bytes: int, where: str) -> bytes:
    """The body at ``url``, reading at most ``max_bytes + 1`` bytes (more than
    ``max_bytes`` means too big: the caller names its limit). Any failure is a
    400: the URL is the client's. The wait gives the preparation's CPU slot up
    (``io_wait``)."""
    _check_host(_host_of(url, where), policy, where)
    guard = _Guard(policy, where)
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}),  # not HTTP(S)_PROXY nor the system's: see above
        _HTTPHandler(guard),
        _HTTPSHandler(guard),
        _RedirectHandler(where),
    )
    request = urllib.request.Request(url, headers={"User-Agent": "kvwarm"})
    chunks: list[bytes] = []
    size = 0
    try:
        with io_wait(), guard, opener.open(request, timeout=policy.timeout) as resp:
            while size <= max_bytes and not guard.expired:
                chunk = resp.read1(min(FETCH_CHUNK, max_bytes + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - any network failure is the client's URL
        if not (guard.expired or _timed_out(exc)):
            raise APIError(400, f"{where}: could not fetch {url[:200]} ({exc}).") from exc
        guard.expired = True
    if guard.expired:
        raise APIError(
            400,
            f"{where}: {url[:200]} did not arrive within {policy.timeout:g} s (--fetch-timeout).",
        )
    return b"".join(chunks)


def _timed_out(exc: BaseException) -> bool:
    reason = getattr(exc, "reason", None)  # urllib wraps connect errors in URLError
    return isinstance(exc, TimeoutError) or isinstance(reason, TimeoutError)


def _host_of(url: str, where: str) -> str:
    try:
        return urllib.parse.urlsplit(url).hostname or ""
    except ValueError as exc:  # "Invalid IPv6 URL", a netloc NFKC changes
        raise APIError(400, f"{where}: {url[:200]} is not a valid URL ({exc}).") from exc


def _check_host(host: str, policy: FetchPolicy, where: str) -> None:
    if not policy.allows(host):
        raise APIError(
            400,
            f"{where}: {host[:200]!r} is not one of the hosts this server fetches from "
            "(--allowed-media-domains).",
        )


# metadata services outside link-local: AWS over IPv6 (Nitro), Alibaba Cloud
_METADATA = {ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")}
# IPv6 forms whose last 32 bits are an IPv4 address a network may translate to:
# NAT64 (RFC 6052), SIIT (::ffff:0:a.b.c.d) and IPv4-compatible (::a.b.c.d)
_LAST_32_BITS = tuple(ipaddress.ip_network(n) for n in ("64:ff9b::/96", "::ffff:0:0:0/96", "::/96"))
# RFC 8215 local-use NAT64, not globally reachable (IANA): an operator's prefix of
# /48 to /96 inside it, each length with its own RFC 6052 layout (octet 8 is zero)
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_RFC6052_OCTETS = ((6, 7, 9, 10), (7, 9, 10, 11), (9, 10, 11, 12), (12, 13, 14, 15))
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")


def _carried(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """Every IPv4 address ``ip`` may carry in a form a network translates (a
    local-use NAT64 address reads differently under each prefix length)."""
    if ip.ipv4_mapped is not None:
        return [ip.ipv4_mapped]
    if ip.sixtofour is not None:
        return [ip.sixtofour]
    if any(ip in net for net in _LAST_32_BITS) and int(ip) > 1:  # not :: or ::1
        return [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)]
    if ip in _NAT64_LOCAL:
        packed = ip.packed
        return [ipaddress.IPv4Address(bytes(packed[i] for i in o)) for o in _RFC6052_OCTETS]
    return []


def _check_address(address: str, host: str, where: str, private: bool = False) -> None:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone
    carried = _carried(ip) if isinstance(ip, ipaddress.IPv6Address) else []
    if isinstance(ip, ipaddress.IPv6Address) and ip in _NAT64_LOCAL:
        # the IPv4 address behind it depends on a prefix length only the network knows
        for v4 in carried:
            if v4 not in _THIS_NETWORK:  # a shorter layout's reading of a longer prefix
                _refuse_special(v4, host, where)
        _refuse_private(ip, host, where, private, reachable=False)
        return
    if carried:
        (ip,) = carried
    _refuse_special(ip, host, where)
    _refuse_private(ip, host, where, private, reachable=ip.is_global)


def _refuse_special(ip: Any, host: str, where: str) -> None:
    kind = (
        "link-local"
        if ip.is_link_local
        else "multicast"
        if ip.is_multicast
        else "unspecified"
        if ip.is_unspecified
        else "cloud metadata"
        if ip in _METADATA
        else None
    )
    if kind:
        raise APIError(
            400,
            f"{where}: {host[:200]!r} is at {ip}, a {kind} address; this server does not "
            "fetch from such addresses.",
        )


def _refuse_private(ip: Any, host: str, where: str, private: bool, reachable: bool) -> None:
    if not reachable and not private:
        # a client may not make the server reach what only it can reach: this
        # machine's services, the LAN behind it (and a port scan through the errors)
        raise APIError(
            400,
            f"{where}: {host[:200]!r} is at {ip}, a loopback or private address; this "
            "server fetches from those only with --fetch-private-urls.",
        )


class _Guard:
    """One fetch's bounds. Its connections (redirects included) go only where
    the policy allows, resolve and connect within the time that remains, and
    their sockets are shut once it is up: a read blocked in another thread then
    fails at once. Sockets, not connections: urllib lets go of a connection's
    socket once the headers are in, while the body is still read through it."""

    def __init__(self, policy: FetchPolicy, where: str):
        self.policy = policy
        self.where = where  # what a refusal names
        self.expired = False
        self._ends = time.monotonic() + policy.timeout
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def __enter__(self) -> _Guard:
        self._timer = threading.Timer(self.policy.timeout, self._expire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def remaining(self) -> float:
        left = self._ends - time.monotonic()
        if left <= 0:
            raise TimeoutError("the fetch deadline passed")
        return left

    def connection(self, cls: type[http.client.HTTPConnection]):
        """``cls``'s constructor: its connections are made and watched by this guard."""

        def make(*args: Any, **kwargs: Any) -> http.client.HTTPConnection:
            conn = cls(*args, **kwargs)
            # http.client's own seam for how a connection's socket is made
            conn._create_connection = lambda address, *_: self._connect(address)  # type: ignore[attr-defined]
            connect = conn.connect

            def connect_watched() -> None:  # https: the TLS socket replaces the raw one
                connect()
                self._watch(conn.sock)

            conn.connect = connect_watched  # type: ignore[method-assign]
            return conn

        return make

    def _connect(self, address: tuple[str, int]) -> socket.socket:
        host, port = address  # as urllib parsed it: the host really connected to
        _check_host(host, self.policy, self.where)
        error: OSError | None = None
        for family, kind, proto, _, sockaddr in _resolve(host, port, self.remaining()):
            _check_address(str(sockaddr[0]), host, self.where, self.policy.private)
            sock = socket.socket(family, kind, proto)
            self._watch(sock)
            try:
                sock.settimeout(self.remaining())
                sock.connect(sockaddr)
                sock.settimeout(self.policy.timeout)  # each read: the watchdog bounds the whole
                return sock
            except OSError as exc:
                sock.close()
                error = exc
                if isinstance(exc, TimeoutError):
                    raise
        raise error or OSError(f"no address for {host}")

    def _watch(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


def _resolve(host: str, port: int, seconds: float) -> list[tuple[Any, ...]]:
    """``getaddrinfo`` within ``seconds``. The system resolver cannot be
    interrupted, so it runs on a daemon thread left to finish on its own when
    time runs out (its own timeouts end it)."""
    try:
        ipaddress.ip_address(host)
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)  # a literal: no lookup
    except ValueError:
        pass
    found: list[Any] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except Exception as exc:  # noqa: BLE001 - OSError, or IDNA's UnicodeError
            found.append(exc)
        done.set()

    threading.Thread(target=lookup, name="kvwarm-resolve", daemon=True).start()
    if not done.wait(seconds):
        raise TimeoutError(f"looking up {host} took over the fetch deadline")
    if isinstance(found[0], Exception):
        raise found[0]
    return found[0]


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, guard: _Guard):
        super().__init__()
        self._guard = guard

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._guard.connection(http.client.HTTPConnection), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, guard: _Guard):
        super().__init__()
        self._guard = guard
        self._tls = ssl.create_default_context()

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(
            self._guard.connection(http.client.HTTPSConnection), req, context=self._tls
        )


class _RedirectHandler(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to http(s): urllib would also take ftp:, outside
    the guard. (Where a redirect may lead is checked when it connects.)"""

    max_redirections = 5

    def __init__(self, where: str):
        super().__init__()
        self._where = where

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            fp.close()  # the redirect's socket, else held until the cyclic GC
            raise APIError(
                400, f"{self._where}: the URL redirects to {newurl[:200]}, not an http(s) URL."
            )
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            # urllib then reads the redirect's body whole, past every byte cap (a 30x
            # with a body of gigabytes): closed, the read gets nothing
            fp.close()
        return new
