"""Downloading a client's image or video URL: bounded in time and in where it goes.

A URL in a request makes this server open a connection on the client's behalf, so
every step of it is bounded by one deadline (``--fetch-timeout``): the name
lookup (the system resolver can take tens of seconds and cannot be interrupted,
so it runs aside and is waited for only as long as time remains), the connect,
the headers and the body (a watchdog shuts the socket however slowly the server
trickles). Where it may go: the hosts of ``--allowed-media-domains`` when set
(checked again on every redirect), never a link-local, multicast or unspecified
address (cloud metadata services live at 169.254.169.254), and redirects only to
http(s). The address checked is the one connected to, so a name that resolves
differently the second time cannot slip past.
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
    _check_host(url, policy, where)
    deadline = _Deadline(policy.timeout, where)
    opener = urllib.request.build_opener(
        _HTTPHandler(deadline), _HTTPSHandler(deadline), _RedirectHandler(policy, where)
    )
    request = urllib.request.Request(url, headers={"User-Agent": "kvwarm"})
    chunks: list[bytes] = []
    size = 0
    try:
        with io_wait(), deadline, opener.open(request, timeout=policy.timeout) as resp:
            while size <= max_bytes and not deadline.expired:
                chunk = resp.read1(min(FETCH_CHUNK, max_bytes + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - any network failure is the client's URL
        if not (deadline.expired or _timed_out(exc)):
            raise APIError(400, f"{where}: could not fetch {url[:200]} ({exc}).") from exc
        deadline.expired = True
    if deadline.expired:
        raise APIError(
            400,
            f"{where}: {url[:200]} did not arrive within {policy.timeout:g} s (--fetch-timeout).",
        )
    return b"".join(chunks)


def _timed_out(exc: BaseException) -> bool:
    reason = getattr(exc, "reason", None)  # urllib wraps connect errors in URLError
    return isinstance(exc, TimeoutError) or isinstance(reason, TimeoutError)


def _check_host(url: str, policy: FetchPolicy, where: str) -> None:
    host = urllib.parse.urlsplit(url).hostname or ""
    if not policy.allows(host):
        raise APIError(
            400,
            f"{where}: {host[:200]!r} is not one of the hosts this server fetches from "
            "(--allowed-media-domains).",
        )


def _check_address(address: str, host: str, where: str) -> None:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    kind = (
        "link-local"
        if ip.is_link_local
        else "multicast"
        if ip.is_multicast
        else "unspecified"
        if ip.is_unspecified
        else None
    )
    if kind:
        raise APIError(
            400,
            f"{where}: {host[:200]!r} is at {ip}, a {kind} address; this server does not "
            "fetch from such addresses.",
        )


class _Deadline:
    """One fetch's time limit. Its connections (redirects included) resolve and
    connect within what remains, and are shut once it is up: a read blocked in
    another thread then fails at once."""

    def __init__(self, seconds: float, where: str):
        self.seconds = seconds
        self.where = where  # what a refused address is reported as
        self.expired = False
        self._ends = time.monotonic() + seconds
        self._connections: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def __enter__(self) -> _Deadline:
        self._ends = time.monotonic() + self.seconds
        self._timer = threading.Timer(self.seconds, self._expire)
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
        """``cls``'s constructor, recording each connection it makes and
        connecting it within the deadline."""

        def make(*args: Any, **kwargs: Any) -> http.client.HTTPConnection:
            conn = cls(*args, **kwargs)
            # http.client's own seam for how a connection's socket is made
            conn._create_connection = lambda address, *_: self._connect(address)  # type: ignore[attr-defined]
            with self._lock:
                self._connections.append(conn)
            if self.expired:
                conn.close()
            return conn

        return make

    def _connect(self, address: tuple[str, int]) -> socket.socket:
        host, port = address
        error: OSError | None = None
        for family, kind, proto, _, sockaddr in _resolve(host, port, self.remaining()):
            _check_address(str(sockaddr[0]), host, self.where)
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(self.remaining())
                sock.connect(sockaddr)
                sock.settimeout(self.seconds)  # each later read: the watchdog bounds the whole
                return sock
            except OSError as exc:
                sock.close()
                error = exc
                if isinstance(exc, TimeoutError):
                    raise
        raise error or OSError(f"no address for {host}")

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            connections = list(self._connections)
        for conn in connections:
            sock = conn.sock
            if sock is not None:
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
        except OSError as exc:
            found.append(exc)
        done.set()

    threading.Thread(target=lookup, name="kvwarm-resolve", daemon=True).start()
    if not done.wait(seconds):
        raise TimeoutError(f"looking up {host} took over the fetch deadline")
    if isinstance(found[0], OSError):
        raise found[0]
    return found[0]


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self._deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._deadline.connection(http.client.HTTPConnection), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self._deadline = deadline
        self._tls = ssl.create_default_context()

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(
            self._deadline.connection(http.client.HTTPSConnection), req, context=self._tls
        )


class _RedirectHandler(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to http(s) (urllib would also take ftp:, outside
    the deadline) and only to a host the policy allows."""

    max_redirections = 5

    def __init__(self, policy: FetchPolicy, where: str):
        super().__init__()
        self._policy = policy
        self._where = where

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise APIError(
                400, f"{self._where}: the URL redirects to {newurl[:200]}, not an http(s) URL."
            )
        _check_host(newurl, self._policy, self._where)
        return super().redirect_request(req, fp, code, msg, headers, newurl)
