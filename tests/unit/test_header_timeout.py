"""A connection that never finishes a request head is closed after --header-timeout:
uvicorn alone held it (and a file descriptor) for ever, however slowly its bytes came.
Requests that did arrive whole are never cut by it, however long they run."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import read_response, serve_app

HEADER_S = 0.6


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    settings = Settings(_env_file=None, header_timeout=HEADER_S)
    app = create_app(settings, lambda s, r: FakeEngine(s, r, step_delay=0.05, eos_after=10_000))
    with serve_app(app, settings=settings) as url:
        yield url


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def closed_after(sock: socket.socket, trickle: bytes = b"", every: float = 0.15) -> float:
    """Seconds until the server closes ``sock``, sending ``trickle`` every ``every`` s
    meanwhile (a header line at a time keeps uvicorn's own timers quiet)."""
    start = time.monotonic()
    sock.settimeout(every)
    while time.monotonic() - start < 10:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - start
        if trickle:
            try:
                sock.sendall(trickle)
            except OSError:  # closed while we wrote
                return time.monotonic() - start
    raise AssertionError("the server kept the connection open for 10 s")


def test_a_silent_connection_is_closed(base):
    with connect(base) as sock:
        waited = closed_after(sock)
    assert HEADER_S * 0.8 <= waited <= HEADER_S + 1.5


def test_a_trickled_head_is_closed_while_bytes_still_come(base):
    with connect(base) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        waited = closed_after(sock, trickle=b"X-Slow: 1\r\n")
    assert HEADER_S * 0.8 <= waited <= HEADER_S + 1.5


def test_after_a_response_the_next_head_has_its_own_deadline(base):
    with connect(base) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # stops uvicorn's keep-alive timer
        waited = closed_after(sock, trickle=b"X-Slow: 1\r\n")
    assert waited <= HEADER_S + 1.5


def test_an_unread_body_after_the_response_is_bounded_too(base):
    with connect(base) as sock:
        sock.sendall(
            b"POST /no-such-route HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\nx"
        )
        assert read_response(sock).startswith(b"HTTP/1.1 404")
        waited = closed_after(sock, trickle=b"x")
    assert waited <= HEADER_S + 1.5


def test_requests_longer_than_the_deadline_and_keep_alive_are_served(base):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
    with httpx.Client(base_url=base, timeout=30) as client:
        start = time.monotonic()
        first = client.post("/v1/chat/completions", json=body)
        assert time.monotonic() - start > HEADER_S * 1.5  # outlived the head deadline
        assert first.status_code == 200
        assert first.json()["usage"]["completion_tokens"] == 30
        time.sleep(HEADER_S / 3)
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert len(events) >= 30


def test_a_client_that_never_reads_its_responses_is_cut_off(base):
    """The response's write waited for room in a full send buffer for ever: the
    connection, its task and megabytes of buffer held by a client that reads nothing."""
    one = len(httpx.get(base + "/openapi.json").content)
    host, port = base.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
        sock.connect((host, int(port)))
        sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 200)
        time.sleep(HEADER_S * 2 + 1)  # reading nothing meanwhile
        received = 0
        sock.settimeout(5)
        try:
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
    assert received < 50 * one  # cut off long before the 200 responses it asked for


def test_a_client_reading_slowly_gets_its_whole_response():
    """A slow reader is no stalled one: one large response keeps the send buffer
    full past the deadline while the client reads it steadily, and it was cut off
    as if it read nothing."""
    size = 4 * 2**20

    async def big(scope, receive, send):  # /health for serve_app, then 4 MiB
        if scope["type"] != "http":
            return
        body = b"x" * (size if scope["path"] == "/big" else 2)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    settings = Settings(_env_file=None, header_timeout=HEADER_S)
    with serve_app(big, settings=settings) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.sendall(b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            received = 0
            sock.settimeout(10)
            try:
                while received < size:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    received += len(chunk)
                    time.sleep(0.002)  # steadily: the 4 MiB take longer than HEADER_S
            except ConnectionResetError:
                pass
    assert received >= size


def test_a_stream_nobody_reads_is_aborted_soon_not_generated_to_its_end():
    """Kernel send buffers autotuned to megabytes took a whole 6,000-token stream
    before the write stalled: generated for nobody, its batch slot and KV held."""
    import json

    settings = Settings(_env_file=None, header_timeout=HEADER_S, batch=1)
    app = create_app(
        settings,
        lambda s, r: FakeEngine(
            s, r, step_delay=0.002, context_length=32_768, kv_budget_tokens=32_768
        ),
    )
    body = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20_000, "stream": True}
    ).encode()
    with serve_app(app, settings=settings) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # reading nothing meanwhile
                stats = httpx.get(url + "/stats").json()
                if stats["requests"]["aborted"]:
                    break
                time.sleep(0.2)
    assert stats["requests"]["aborted"] == 1
    assert stats["engine"]["generated_tokens"] < 6000
