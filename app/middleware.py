"""Pure ASGI middleware: the Host allowlist, API-key auth and a request-body size limit.

All three answer before the body is read (the limit trusts Content-Length when sent
and counts bytes of chunked bodies as they arrive).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from starlette._utils import parse_host_header
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ANTHROPIC_PATHS, APIError, count_refusal, error_payload
from app.host_names import host_matches, host_pattern
from scheduler.request import next_request_id

OPEN_PATHS = frozenset({"/health", "/metrics"})  # Prometheus scrapes without a key, as with vLLM


async def _send_error(
    scope: Scope,
    send: Send,
    status: int,
    message: str,
    error_type: str,
    code: str,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps(error_payload(scope["path"], status, message, error_type, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    headers += extra or []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class HostCheckMiddleware(TrustedHostMiddleware):
    """Starlette's Host allowlist (exact names, or ``*.domain``), refusing an unknown
    host with the JSON error body every other 400 has (Starlette's is plain text).
    An item with a port (``mybox.local:8080``) answers that port only: Starlette
    compared the bare name with it, so such an item never matched."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]):
        patterns = [host_pattern(item) for item in allowed_hosts if item != "*"]
        names = ["*"] if "*" in allowed_hosts else [p.name for p in patterns]
        super().__init__(app, names, www_redirect=False)
        self.patterns = patterns

    def _allowed(self, scope: Scope) -> bool:
        parsed = parse_host_header(Headers(scope=scope).get("host"))
        if parsed is None:
            return False
        host = parsed.host.lower()
        return any(host_matches(pattern, host, parsed.port) for pattern in self.patterns)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allow_any or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # Starlette's own refusal
            await PlainTextResponse("Invalid host header", 400)(scope, receive, send)
            return
        await _send_error(
            scope,
            send,
            400,
            "Invalid Host header: this server answers only the names --allowed-hosts lists "
            "(loopback names when bound to loopback; an item with a :port, only that port).",
            "invalid_request_error",
            "invalid_host",
        )


class PreflightCORS(CORSMiddleware):
    """Starlette's CORS, refusing a preflight in the route's JSON error shape
    (Starlette's is text/plain "Disallowed CORS origin"), its 400 and headers kept."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        preflight = scope["type"] == "http" and scope["method"] == "OPTIONS"
        headers = Headers(scope=scope) if preflight else Headers()
        if not (preflight and "origin" in headers and "access-control-request-method" in headers):
            await super().__call__(scope, receive, send)
            return
        response = self.preflight_response(request_headers=headers)
        if response.status_code != 400:
            await response(scope, receive, send)
            return
        kept = [
            (name, value)
            for name, value in response.raw_headers
            if name not in (b"content-type", b"content-length")
        ]
        failures = bytes(response.body).decode().removeprefix("Disallowed CORS ")
        origin = headers["origin"][:200]
        if "origin" in failures.split(", "):
            message = (
                f"CORS preflight refused: the web origin {origin!r} is not allowed; start "
                "kvwarm with --cors-origins naming it to allow a page there to call this server."
            )
            code = "origin_not_allowed"
        else:
            message = f"CORS preflight refused: the requested {failures} are not allowed."
            code = "cors_not_allowed"
        await _send_error(scope, send, 400, message, "invalid_request_error", code, kept)


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class CrossOriginGuard:
    """Refuses a state-changing request a web page sent from an origin not in
    ``--cors-origins``. CORS only keeps the page from reading the answer: a
    ``text/plain`` or form POST needs no preflight, so any page the user opened
    could otherwise mount adapters, fill the queue or save conversations on a
    loopback server without a key. Clients that are not browsers send no Origin;
    desktop apps' own schemes (``tauri://``, ``vscode-webview://``) are no web page."""

    def __init__(self, app: ASGIApp, allowed: list[str], own_hosts_checked: bool = True):
        self.app = app
        self.allowed = frozenset(allowed)
        # the server's own pages are told by Origin == Host only where the Host is
        # checked (--allowed-hosts, or loopback names): answering any Host, a page
        # whose name was rebound to this server's address matched it too
        self.own_hosts_checked = own_hosts_checked

    def _permitted(self, scope: Scope, origin: str) -> bool:
        if "*" in self.allowed or origin in self.allowed:
            return True
        scheme, sep, host = origin.partition("://")
        if not sep or scheme.lower() not in ("http", "https"):
            return bool(sep)  # an app's own scheme; "null" (a sandboxed page) is refused
        if host.lower() == "tauri.localhost":  # Tauri's webview on Windows
            return True
        # the server's own pages (/docs), whatever scheme a TLS proxy in front adds
        own = host.lower() == (Headers(scope=scope).get("host") or "").lower()
        return own and self.own_hosts_checked

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        origin = Headers(scope=scope).get("origin")
        if origin is None or self._permitted(scope, origin):
            await self.app(scope, receive, send)
            return
        await _send_error(
            scope,
            send,
            403,
            f"Requests from the web origin {origin[:200]!r} are refused: start kvwarm with "
            "--cors-origins naming it to allow a page there to call this server"
            + (
                "."
                if self.own_hosts_checked
                else ", or --allowed-hosts naming this server for its own pages (/docs)."
            ),
            "permission_error",
            "origin_not_allowed",
        )


class OpenRequests:
    """Counts HTTP requests being served, from their head to their last byte:
    one still receiving its body or being prepared is not yet the scheduler's,
    and a drain that waited only for the scheduler's cut it off with a 500."""

    def __init__(self, app: ASGIApp, counter: RequestCounter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.counter.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.open -= 1


class RequestCounter:
    open: int = 0  # one event loop: no lock


REQUEST_ID = "kvwarm.request_id"  # scope key: the id a route gave its request (its logs')


class RequestIdHeader:
    """Every response names its request: ``request-id`` on Anthropic's routes,
    ``x-request-id`` on the others, the names their SDKs read (``_request_id``)
    and a user quotes in a report. A route that made a scheduler request puts
    that request's id (the one its log lines carry) under ``REQUEST_ID``; any
    other response, an early refusal included, gets a fresh one."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        anthropic = scope["path"].startswith(ANTHROPIC_PATHS)
        name = b"request-id" if anthropic else b"x-request-id"

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                request_id = scope.get(REQUEST_ID) or next_request_id()
                headers = [*message.get("headers", ()), (name, request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, named)


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    def _presented(self, scope: Scope) -> bytes | None:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            return auth[7:].strip()
        return headers.get(b"x-api-key")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        presented = self._presented(scope) or b""
        if not hmac.compare_digest(presented, self.api_key):
            await _send_error(
                scope,
                send,
                401,
                "Invalid or missing API key.",
                "authentication_error",
                "invalid_api_key",
            )
            return
        await self.app(scope, receive, send)


RELEASE_BODY = "kvwarm.release_body"  # scope key: a request's body is no longer held
BODY_RECEIVED = "kvwarm.body_received"  # scope key: when its last body byte came (monotonic)
MIN_BODY_RATE = 256 * 1024  # bytes a second a body must average (after --body-timeout)


def _carries_body(head: dict[bytes, bytes]) -> bool:
    length = head.get(b"content-length")
    return b"transfer-encoding" in head or (length is not None and length.strip() != b"0")


def _encoded(head: dict[bytes, bytes]) -> bool:
    codings = head.get(b"content-encoding", b"").lower().split(b",")
    return any(c.strip() not in (b"", b"identity") for c in codings)


async def _refuse_encoding(scope: Scope, send: Send, coding: bytes) -> None:
    """A compressed body would be parsed as JSON and refused as "not valid JSON",
    which sends the user looking for a mistake in the JSON (RFC 9110 15.5.16)."""
    count_refusal(scope, 415, "unsupported_content_encoding")
    name = coding.decode("latin-1")[:64]
    await _send_error(
        scope,
        send,
        415,
        f"Content-Encoding {name!r} is not supported: send the request body uncompressed "
        "(Content-Encoding: identity, or none).",
        "invalid_request_error",
        "unsupported_content_encoding",
        [(b"accept-encoding", b"identity")],
    )


class BodyLimitMiddleware:
    """Bounds request bodies: each one's size (413), all of them held at once
    (503 beyond ``max_in_flight`` bytes until each is prepared: a client could
    otherwise open many connections that each send most of a 32 MiB body, and
    hold it), and the time they take (408 after ``idle_timeout`` s without a
    chunk, or past the rate below: a body that stops coming, or trickles, would
    hold its bytes for ever)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_in_flight: int, idle_timeout: float):
        self.app = app
        self.max_bytes = max_bytes
        self.max_in_flight = max_in_flight
        self.idle_timeout = idle_timeout
        self.in_flight = 0  # body bytes received and not yet prepared (one event loop)

    def _message(self) -> str:
        return f"Request body exceeds the limit of {self.max_bytes} bytes (--max-body-bytes)."

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = dict(scope.get("headers") or [])
        length = head.get(b"content-length")
        if _carries_body(head) and _encoded(head):
            await _refuse_encoding(scope, send, head[b"content-encoding"])
            return
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            count_refusal(scope, 413, "body_too_large")
            await _send_error(
                scope, send, 413, self._message(), "invalid_request_error", "body_too_large"
            )
            return
        received = held = 0
        complete = False
        # a body trickled a byte at a time would never pause long enough for the idle
        # timeout while holding its share of the budget: the whole of it must also
        # arrive at MIN_BODY_RATE or better, after a first --body-timeout
        expected = int(length) if length is not None and length.isdigit() else self.max_bytes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.idle_timeout + expected / MIN_BODY_RATE

        async def limited_receive() -> Message:
            nonlocal received, held, complete
            if complete:  # past the body: a disconnect may be waited for as long as it takes
                return await receive()
            left = deadline - loop.time()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, min(self.idle_timeout, left)))
            except asyncio.TimeoutError:
                what = (
                    f"No request body data for {self.idle_timeout:g} s (--body-timeout)."
                    if left > self.idle_timeout
                    else f"The request body arrived slower than {MIN_BODY_RATE // 1024} KiB/s."
                )
                # a code, as the 413 body_too_large and 503 bodies_busy have
                raise APIError(408, what, code="body_timeout") from None
            if message["type"] != "http.request":
                return message
            chunk = len(message.get("body", b""))
            received += chunk
            if received > self.max_bytes:
                # the same 413 as a Content-Length over the limit, code and all
                raise APIError(413, self._message(), code="body_too_large")
            if self.in_flight + chunk > self.max_in_flight:
                raise APIError(
                    503,
                    f"Request bodies of {self.in_flight} bytes are already held; the limit "
                    f"is {self.max_in_flight} (--max-bodies-bytes). Retry shortly.",
                    "overloaded_error",
                    code="bodies_busy",
                    headers={"Retry-After": "1"},
                )
            self.in_flight += chunk
            held += chunk
            complete = not message.get("more_body", False)
            if complete:  # the client's wait starts here: parsing and rendering count
                scope[BODY_RECEIVED] = time.monotonic()
            return message

        def release() -> None:
            nonlocal held
            self.in_flight -= held
            held = 0

        # the route releases the body once it is prepared (app.body.Preparer.body):
        # a generation that runs for minutes holds parsed objects, not these bytes
        scope[RELEASE_BODY] = release
        try:
            await self.app(scope, limited_receive, send)
        finally:
            release()
