"""Run a kvwarm FastAPI app on a real socket in a background thread."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from app.lifecycle import server_config
from app.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_app(
    app, wait_ready: bool = True, timeout: float = 60, settings: Settings | None = None
) -> Iterator[str]:
    """``settings`` given: uvicorn configured as ``kvwarm serve`` configures it."""
    port = free_port()
    if settings is None:
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"
        )
    else:
        config = server_config(app, settings.model_copy(update={"port": port}))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = httpx.get(f"{base}/health", timeout=2).status_code
            if status == 200 or (not wait_ready and status == 503):
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"server on {base} did not become ready")
        time.sleep(0.05)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(15)


def wait_for_process(
    proc: subprocess.Popen, url: str, log: Path, what: str, timeout: float
) -> None:
    """Poll ``url`` until it answers 200; fail with the log's tail if ``proc``
    exits or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"{what} exited early:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{what} not ready:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def read_response(sock: socket.socket, data: bytes = b"") -> bytes:
    """One whole HTTP/1.1 response from ``sock``: the head and its Content-Length
    body, which may arrive in several reads (``data``: what was already read)."""
    sock.settimeout(10)
    while b"\r\n\r\n" not in data:
        data += _more(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += _more(sock)
    return head + b"\r\n\r\n" + body


def _more(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise AssertionError("the server closed the connection inside a response")
    return chunk
