"""Image downloads and video decoding: bounded in time, and never holding other
agents' request preparation back while they wait."""

from __future__ import annotations

import asyncio
import io
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from PIL import Image

from app.body import Preparer, io_wait
from app.errors import APIError
from app.images import ImageLimits, ImageSource, load_images


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


@contextmanager
def http_server(
    body: bytes, pause: float = 0.0, length: int | None = None, slow_head: bool = False
) -> Iterator[str]:
    """One-connection-at-a-time HTTP server sending ``body`` a byte every ``pause``
    seconds (0: all at once), announcing ``length`` bytes; ``slow_head``: its
    headers too, a byte at a time (endless ones)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {length or len(body)}\r\n\r\n"
                data, gap = body, pause
                if slow_head:  # the headers are the slow part, and they never end
                    data, gap = ("HTTP/1.1 200 OK\r\nX-Padding: " + "x" * 100_000).encode(), 0.1
                    head = ""
                try:
                    conn.sendall(head.encode())
                    if not gap:
                        conn.sendall(data)
                        continue
                    for i in range(len(data)):
                        if stop.is_set():
                            break
                        conn.sendall(data[i : i + 1])
                        time.sleep(gap)
                except OSError:
                    pass  # the client gave up

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_url_is_read_in_chunks_into_the_same_image():
    with http_server(png()) as url:
        ((image,),) = load_images([ImageSource(url=url)], ImageLimits())
    assert image.image.size == (3, 2)


def test_a_url_over_the_size_limit_is_refused_naming_it():
    with http_server(b"x" * 5000) as url, pytest.raises(APIError) as err:
        load_images([ImageSource(url=url)], ImageLimits(max_image_bytes=1000))
    assert err.value.status == 400 and "--max-image-bytes" in err.value.message


def test_a_trickling_server_cannot_hold_a_request_past_the_fetch_timeout():
    """urllib's timeout is per read: a byte every 0.1 s would have taken 200 s."""
    began = time.monotonic()
    with http_server(b"x" * 2000, pause=0.1) as url, pytest.raises(APIError) as err:
        load_images([ImageSource(url=url)], ImageLimits(fetch_timeout=0.5))
    assert time.monotonic() - began < 3
    assert err.value.status == 400 and "--fetch-timeout" in err.value.message


def test_a_server_trickling_its_headers_is_cut_at_the_fetch_timeout_too():
    began = time.monotonic()
    with http_server(b"", slow_head=True) as url, pytest.raises(APIError) as err:
        load_images([ImageSource(url=url)], ImageLimits(fetch_timeout=0.5))
    assert time.monotonic() - began < 3
    assert err.value.status == 400 and "--fetch-timeout" in err.value.message


def test_https_goes_through_the_same_watched_handler():
    # a plain-HTTP server answering a TLS hello: a clear 400, at once
    with http_server(png()) as url, pytest.raises(APIError) as err:
        load_images([ImageSource(url=url.replace("http:", "https:"))], ImageLimits())
    assert err.value.status == 400 and "could not fetch" in err.value.message


def test_a_job_waiting_on_io_gives_its_cpu_slot_to_other_requests():
    async def scenario() -> None:
        preparer = Preparer(threads=1, media_waits=1)
        waiting, release = threading.Event(), threading.Event()

        def download() -> str:
            with io_wait():
                waiting.set()
                release.wait(10)
            return "image"

        def text_request() -> int:
            return 42

        slow = asyncio.ensure_future(preparer.run(download))
        while not waiting.is_set():
            await asyncio.sleep(0.01)
        # the one CPU slot is free while the download waits
        assert await asyncio.wait_for(preparer.run(text_request), 5) == 42
        # past --media-waits, another wait is refused (503), not queued behind it
        with pytest.raises(APIError) as err:
            await asyncio.wait_for(preparer.run(download), 5)
        assert err.value.status == 503 and err.value.code == "media_busy"
        assert err.value.headers == {"Retry-After": "1"}
        release.set()
        assert await asyncio.wait_for(slow, 5) == "image"

    asyncio.run(scenario())


def test_io_wait_outside_a_preparation_changes_nothing():
    with io_wait():
        pass
