"""Request bodies held at once are bounded, a stalled or trickled body is cut,
and a stored conversation larger than a body is refused before parsing."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from app.middleware import BodyLimitMiddleware
from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import read_response, serve_app
from tests.unit.test_reliability import (
    CHAT,
    MESSAGES,
    RESPONSES,
    chat,
    responses,
)


def _partial_body(url: str, announced: int, sent: int) -> socket.socket:
    """A connection that announces ``announced`` body bytes, sends ``sent`` and stalls."""
    host, port = url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)))
    conn.sendall(
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {announced}\r\n\r\n".encode()
        + b" " * sent
    )
    return conn


def test_bodies_held_at_once_are_bounded_and_a_stalled_body_times_out():
    """Connections that each send most of a large body and stop held it for ever
    (12 x 30 MiB: +371 MiB resident): past --max-bodies-bytes a new body is a 503
    worth retrying, and a body that pauses past --body-timeout is a 408."""
    settings = Settings(
        _env_file=None, max_body_bytes="1MB", max_bodies_bytes="1MB", body_timeout=1.5
    )
    app = create_app(settings, lambda s, r: FakeEngine(s, r, eos_after=2))
    with serve_app(app) as url:
        stalled = _partial_body(url, 900_000, 800_000)
        try:
            time.sleep(0.3)  # its chunks are in
            r = httpx.post(url + CHAT, content=b" " * 300_000 + b"{}", timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "bodies_busy"
            # the stalled body is cut at the timeout, and its bytes are released
            stalled.settimeout(10)
            began = time.monotonic()
            answer = stalled.recv(65536).decode()
            assert answer.startswith("HTTP/1.1 408"), answer
            assert time.monotonic() - began < 5
        finally:
            stalled.close()
        r = httpx.post(url + CHAT, content=b" " * 300_000 + b"{}", timeout=10)
        assert r.status_code == 400  # read in full and validated: not refused for room
        assert httpx.post(url + CHAT, json=chat(), timeout=10).status_code == 200
    # a body counts only until it is prepared, not while its reply generates
    app = create_app(settings, lambda s, r: FakeEngine(s, r, step_delay=0.5, eos_after=8))
    with serve_app(app) as url:
        middleware = app.middleware_stack
        while not isinstance(middleware, BodyLimitMiddleware):
            middleware = middleware.app
        body = b" " * 600_000 + json.dumps(chat(max_tokens=8)).encode()
        slow = threading.Thread(
            target=lambda: httpx.post(
                url + CHAT, content=body, headers={"content-type": "application/json"}, timeout=30
            )
        )
        slow.start()
        time.sleep(1.5)
        assert slow.is_alive() and middleware.in_flight == 0
        slow.join(30)


def test_a_body_trickled_a_byte_at_a_time_is_cut_too():
    """Never pausing past --body-timeout, a trickle would hold its share of
    --max-bodies-bytes for ever: the whole body must average MIN_BODY_RATE."""
    settings = Settings(_env_file=None, max_body_bytes="1MB", body_timeout=1.0)
    app = create_app(settings, lambda s, r: FakeEngine(s, r, eos_after=2))
    with serve_app(app) as url:
        conn = _partial_body(url, 500_000, 400_000)  # allowed 1 + 500 KB / 256 KiB/s ~ 2.9 s
        conn.settimeout(0.3)
        began, answer = time.monotonic(), b""
        try:
            while not answer and time.monotonic() - began < 10:
                try:
                    conn.sendall(b" ")
                    answer = conn.recv(65536)
                except TimeoutError:
                    continue
            took = time.monotonic() - began
            answer = read_response(conn, answer)  # the head and body may come in two reads
        finally:
            conn.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"slower than" in answer, answer
        assert took < 6
        # a code, as 413 body_too_large and 503 bodies_busy have (it was null)
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "body_timeout"
        metrics = httpx.get(url + "/metrics").text
    assert 'reason="body_timeout"} 1.0' in metrics  # a refused request, on the dashboard


def test_a_body_over_the_limit_counts_as_refused_however_it_is_sent():
    """The middleware answered a Content-Length over --max-body-bytes itself, and a
    chunked body past it raised where no handler counted it: neither reached
    requests_rejected_total."""
    settings = Settings(_env_file=None, max_body_bytes="2KB")
    app = create_app(settings, lambda s, r: FakeEngine(s, r, eos_after=2))
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * 5000}])).encode()
    with serve_app(app) as url:
        announced = httpx.post(url + CHAT, content=big)
        assert announced.status_code == 413
        chunked = httpx.post(url + CHAT, content=iter([big[:1500], big[1500:]]))
        assert chunked.status_code == 413
        # one refusal, one error code, however the body came (chunked had none)
        codes = {r.json()["error"]["code"] for r in (announced, chunked)}
        assert codes == {"body_too_large"}
        metrics = httpx.get(url + "/metrics").text
    assert 'reason="invalid"} 2.0' in metrics


def test_a_stored_conversation_larger_than_a_body_is_refused_not_parsed():
    """A 120-byte request naming a 60 MiB stored conversation cost 3 s of a preparation
    slot each time; the stored history is held to the limits a body is."""
    settings = Settings(_env_file=None, max_body_bytes="1MB")
    app = create_app(settings, lambda s, r: FakeEngine(s, r, eos_after=2))

    def turn(previous=None, reasoning="x" * 600_000):  # reasoning the template never renders
        items = [
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": reasoning}]},
            {"type": "message", "role": "assistant", "content": "ok"},
            {"type": "message", "role": "user", "content": "next"},
        ]
        extra = {"previous_response_id": previous} if previous else {}
        return httpx.post(url + RESPONSES, json=responses(input=items, **extra), timeout=30)

    with serve_app(app) as url:
        first = turn()
        assert first.status_code == 200, first.text
        second = turn(first.json()["id"])  # stores 1.2 MB: the history and this input
        assert second.status_code == 200, second.text
        third = turn(second.json()["id"], reasoning="short")
        assert third.status_code == 400, third.text
        err = third.json()["error"]
        assert (err["code"], err["param"]) == (
            "previous_response_too_large",
            "previous_response_id",
        )
        assert turn(first.json()["id"], reasoning="short").status_code == 200


async def test_websocket_scopes_keep_starlettes_host_check():
    from app.middleware import HostCheckMiddleware

    reached: list[dict] = []

    async def inner(scope, receive, send):
        reached.append(scope)

    async def receive():
        return {"type": "websocket.connect"}

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    check = HostCheckMiddleware(inner, ["localhost"])
    scope = {"type": "websocket", "path": "/", "headers": [(b"host", b"evil.example")]}
    await check(scope, receive, send)
    assert not reached and sent  # refused before the app
    await check({**scope, "headers": [(b"host", b"localhost:8000")]}, receive, send)
    assert len(reached) == 1


def test_a_compressed_body_is_refused_as_an_encoding_before_it_is_read():
    """A gzip body was parsed as JSON and refused as "not valid JSON", which sent the
    user looking for a JSON mistake: it is a 415 naming the encoding, answered
    from the head alone (this one's body never comes)."""
    import gzip

    settings = Settings(_env_file=None, body_timeout=60)
    app = create_app(settings, lambda s, r: FakeEngine(s, r, eos_after=2))
    packed = gzip.compress(json.dumps(chat()).encode())
    with serve_app(app) as url:
        gz = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        r = httpx.post(url + CHAT, content=packed, headers=gz)
        assert r.status_code == 415, r.text
        err = r.json()["error"]
        assert err["code"] == "unsupported_content_encoding"
        assert "gzip" in err["message"] and "identity" in err["message"]
        assert r.headers["accept-encoding"] == "identity"
        r = httpx.post(url + MESSAGES, content=packed, headers={**gz, "Content-Encoding": "br"})
        assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
        ok = httpx.post(url + CHAT, json=chat(), headers={"Content-Encoding": "identity"})
        assert ok.status_code == 200, ok.text
        assert httpx.get(url + "/health", headers={"Content-Encoding": "gzip"}).status_code == 200
        host, port = url.removeprefix("http://").split(":")
        stalled = socket.create_connection((host, int(port)))
        try:
            stalled.sendall(
                f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Encoding: deflate\r\n"
                "Content-Length: 1000\r\n\r\n".encode()
            )
            answer = read_response(stalled)  # long before --body-timeout
        finally:
            stalled.close()
        assert answer.startswith(b"HTTP/1.1 415"), answer
        metrics = httpx.get(url + "/metrics").text
    assert 'reason="invalid"} 3.0' in metrics
