"""Image downloads and video decoding: bounded in time, and never holding other
agents' request preparation back while they wait."""

from __future__ import annotations

import asyncio
import io
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from PIL import Image

from app.body import Preparer, decoder_wait, io_wait
from app.cli import build_parser, load_settings
from app.errors import APIError
from app.images import ImageLimits, ImageSource, load_images
from app.media_fetch import FetchPolicy


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


@contextmanager
def serving(answer: Callable[[socket.socket, threading.Event], None]) -> Iterator[str]:
    """A one-connection-at-a-time HTTP server on loopback: ``answer(conn, stop)``
    replies to each request (already read); yields a URL on it."""
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
                try:
                    answer(conn, stop)
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


def http_server(
    body: bytes, pause: float = 0.0, length: int | None = None, slow_head: bool = False
):
    """``body`` a byte every ``pause`` seconds (0: all at once), announcing
    ``length`` bytes; ``slow_head``: its headers too, a byte at a time (endless ones)."""

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {length or len(body)}\r\n\r\n"
        data, gap = body, pause
        if slow_head:  # the headers are the slow part, and they never end
            data, gap = ("HTTP/1.1 200 OK\r\nX-Padding: " + "x" * 100_000).encode(), 0.1
            head = ""
        conn.sendall(head.encode())
        if not gap:
            conn.sendall(data)
            return
        for i in range(len(data)):
            if stop.is_set():
                break
            conn.sendall(data[i : i + 1])
            time.sleep(gap)

    return serving(answer)


def test_a_url_is_read_in_chunks_into_the_same_image():
    with http_server(png()) as url:
        ((image,),) = load_images([ImageSource(url=url)], ImageLimits(fetch_private_urls=True))
    assert image.image.size == (3, 2)


def test_a_url_over_the_size_limit_is_refused_naming_it():
    with http_server(b"x" * 5000) as url, pytest.raises(APIError) as err:
        load_images(
            [ImageSource(url=url)], ImageLimits(max_image_bytes=1000, fetch_private_urls=True)
        )
    assert err.value.status == 400 and "--max-image-bytes" in err.value.message


def test_a_trickling_server_cannot_hold_a_request_past_the_fetch_timeout():
    """urllib's timeout is per read: a byte every 0.1 s would have taken 200 s."""
    began = time.monotonic()
    with http_server(b"x" * 2000, pause=0.1) as url, pytest.raises(APIError) as err:
        load_images([ImageSource(url=url)], ImageLimits(fetch_timeout=0.5, fetch_private_urls=True))
    assert time.monotonic() - began < 3
    assert err.value.status == 400 and "--fetch-timeout" in err.value.message


def test_a_server_trickling_its_headers_is_cut_at_the_fetch_timeout_too():
    began = time.monotonic()
    with http_server(b"", slow_head=True) as url, pytest.raises(APIError) as err:
        load_images([ImageSource(url=url)], ImageLimits(fetch_timeout=0.5, fetch_private_urls=True))
    assert time.monotonic() - began < 3
    assert err.value.status == 400 and "--fetch-timeout" in err.value.message


def test_https_goes_through_the_same_watched_handler():
    # a plain-HTTP server answering a TLS hello: a clear 400, at once
    with http_server(png()) as url, pytest.raises(APIError) as err:
        load_images(
            [ImageSource(url=url.replace("http:", "https:"))], ImageLimits(fetch_private_urls=True)
        )
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
    with decoder_wait(1.0):
        pass


def test_decoding_subprocesses_run_one_at_a_time_without_holding_cpu_slots():
    """ffmpeg ran as an idle wait: eight at once, a core each, beside the CPU slots,
    starved the engine thread on a two-core host."""

    async def scenario() -> None:
        preparer = Preparer(threads=1, media_waits=4, decoders=1)
        running: list[int] = []
        most = [0]
        lock = threading.Lock()
        first_in, release = threading.Event(), threading.Event()

        def video(i: int) -> int:
            with decoder_wait(10.0):
                with lock:
                    running.append(i)
                    most[0] = max(most[0], len(running))
                first_in.set()
                release.wait(10)
                with lock:
                    running.remove(i)
            return i

        videos = [asyncio.ensure_future(preparer.run(lambda i=i: video(i))) for i in range(3)]
        while not first_in.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the others reach their wait for the decoder
        assert most[0] == 1
        # every video gave its CPU slot up: a text request still prepares
        assert await asyncio.wait_for(preparer.run(lambda: 42), 5) == 42
        release.set()
        assert sorted(await asyncio.wait_for(asyncio.gather(*videos), 10)) == [0, 1, 2]
        assert most[0] == 1

    asyncio.run(scenario())


# -- where a fetch may go, and its name lookup --------------------------------


def redirecting_server(location: str):
    """Answers every request with a redirect to ``location``."""
    reply = f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n"
    return serving(lambda conn, _: conn.sendall(reply.encode()))


def test_a_host_outside_the_allowed_media_domains_is_refused_naming_the_flag():
    with http_server(png()) as url, pytest.raises(APIError) as err:
        load_images(
            [ImageSource(url=url)],
            ImageLimits(allowed_media_domains=("example.com",), fetch_private_urls=True),
        )
    assert err.value.status == 400 and "--allowed-media-domains" in err.value.message
    # the same URL with its host allowed is fetched
    with http_server(png()) as url:
        ((image,),) = load_images(
            [ImageSource(url=url)],
            ImageLimits(allowed_media_domains=("127.0.0.1",), fetch_private_urls=True),
        )
    assert image.image.size == (3, 2)


def test_an_allowed_host_cannot_redirect_the_fetch_elsewhere():
    with (
        http_server(png()) as target,
        redirecting_server(target.replace("127.0.0.1", "localhost")) as url,
    ):
        # followed when any host may be fetched
        ((image,),) = load_images([ImageSource(url=url)], ImageLimits(fetch_private_urls=True))
        assert image.image.size == (3, 2)
        with pytest.raises(APIError) as err:
            load_images(
                [ImageSource(url=url)],
                ImageLimits(allowed_media_domains=("127.0.0.1",), fetch_private_urls=True),
            )
    assert err.value.status == 400 and "'localhost'" in err.value.message
    assert "--allowed-media-domains" in err.value.message


def test_a_redirects_own_body_is_not_read():
    """urllib reads a 30x's body whole before following it, past every byte cap:
    an endless one held the fetch (and its memory) to the deadline."""

    with http_server(png()) as target:

        def endless_redirect(conn: socket.socket, stop: threading.Event) -> None:
            head = f"HTTP/1.1 302 Found\r\nLocation: {target}\r\n\r\n"  # a body to EOF
            conn.sendall(head.encode())
            while not stop.is_set():
                conn.sendall(b"x" * 65536)

        with serving(endless_redirect) as url:
            ((image,),) = load_images(
                [ImageSource(url=url)], ImageLimits(fetch_timeout=3, fetch_private_urls=True)
            )
    assert image.image.size == (3, 2)


def test_a_redirect_to_another_scheme_is_refused():
    with redirecting_server("ftp://127.0.0.1/cat.png") as url, pytest.raises(APIError) as err:
        load_images([ImageSource(url=url)], ImageLimits(fetch_private_urls=True))
    assert err.value.status == 400 and "not an http(s) URL" in err.value.message


def resolving_to(monkeypatch, address: str) -> list[object]:
    """Every name resolves to ``address``; returns the connects attempted (none happen)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sockaddr = (address, 80, 0, 0) if family == socket.AF_INET6 else (address, 80)
    connects: list[object] = []
    monkeypatch.setattr(
        "app.media_fetch.socket.getaddrinfo",
        lambda *a, **k: [(family, socket.SOCK_STREAM, 6, "", sockaddr)],
    )
    monkeypatch.setattr("app.media_fetch.socket.socket.connect", connects.append)
    return connects


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",
        "fe80::1",
        "::ffff:169.254.169.254",
        "2002:a9fe:a9fe::",  # 6to4 of 169.254.169.254
        "64:ff9b::a9fe:a9fe",  # NAT64 of it
        "64:ff9b:1:a9fe:a9:fe00::",  # local-use NAT64 (RFC 8215): a /48 prefix's layout
        "64:ff9b:1:101:a9:fea9:fe00:0",  # a /64 prefix's
        "64:ff9b:1:101::a9fe:a9fe",  # a /96 prefix's
        "::ffff:0:a9fe:a9fe",  # SIIT
        "::a9fe:a9fe",  # IPv4-compatible
        "fd00:ec2::254",  # AWS's metadata service over IPv6
        "100.100.100.200",  # Alibaba Cloud's
        "224.0.0.1",
        "0.0.0.0",
    ],
)
def test_link_local_multicast_and_unspecified_addresses_are_never_fetched(monkeypatch, address):
    """Checked on the address connected to: a harmless-looking name resolving to
    the cloud metadata service is refused too."""
    connects = resolving_to(monkeypatch, address)
    with pytest.raises(APIError) as err:
        load_images(
            [ImageSource(url="http://images.example.com/cat.png")],
            ImageLimits(fetch_private_urls=True),
        )
    assert err.value.status == 400 and "does not fetch from such addresses" in err.value.message
    assert connects == []


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "::1", "10.0.0.5", "192.168.1.1", "172.17.0.1", "::ffff:127.0.0.1",
                "fd12::1", "100.64.0.1", "64:ff9b:1::5db8:d822"],
)  # fmt: skip
def test_loopback_and_private_addresses_are_fetched_only_when_allowed(monkeypatch, address):
    """Any client could make the server GET this machine's services and its LAN,
    and read which ports answer from the errors."""
    connects = resolving_to(monkeypatch, address)
    with pytest.raises(APIError) as err:
        load_images([ImageSource(url="http://images.example.com/cat.png")], ImageLimits())
    assert err.value.status == 400 and "--fetch-private-urls" in err.value.message
    assert connects == []


def test_a_loopback_image_server_is_fetched_with_the_flag():
    with http_server(png()) as url:
        with pytest.raises(APIError):
            load_images([ImageSource(url=url)], ImageLimits())
        ((image,),) = load_images([ImageSource(url=url)], ImageLimits(fetch_private_urls=True))
    assert image.image.size == (3, 2)
    flag = build_parser().parse_args(["serve", "--fetch-private-urls"])
    assert load_settings(flag).image_limits.fetch_private_urls


def test_a_proxy_in_the_environment_is_not_used(monkeypatch):
    """A proxy would connect wherever the URL says: the address checks would see
    only the proxy's."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with http_server(png()) as url:
        ((image,),) = load_images([ImageSource(url=url)], ImageLimits(fetch_private_urls=True))
    assert image.image.size == (3, 2)


@pytest.mark.parametrize("url", ["http://[::1/cat.png", "http://a..b.example/cat.png"])
def test_a_malformed_url_or_host_name_is_a_400_at_once(url):
    began = time.monotonic()
    with pytest.raises(APIError) as err:
        load_images([ImageSource(url=url)], ImageLimits(fetch_timeout=5, fetch_private_urls=True))
    assert err.value.status == 400 and "--fetch-timeout" not in err.value.message
    assert time.monotonic() - began < 2.5


def test_a_body_that_stalls_after_the_headers_is_cut_at_the_deadline():
    """urllib lets go of the connection's socket once the headers are in: the
    watchdog must still shut the one the body is read from. A read begun just
    before the deadline would otherwise wait out a whole socket timeout more."""
    with http_server(b"xxx", pause=1.8) as url:
        began = time.monotonic()
        with pytest.raises(APIError) as err:
            load_images(
                [ImageSource(url=url)], ImageLimits(fetch_timeout=2.0, fetch_private_urls=True)
            )
        took = time.monotonic() - began
    assert err.value.status == 400 and "--fetch-timeout" in err.value.message
    assert took < 3.0  # not 1.8 + 2


def test_a_name_lookup_that_hangs_is_cut_at_the_fetch_timeout(monkeypatch):
    """The system resolver cannot be interrupted: the fetch stops waiting for it."""
    release = threading.Event()

    def hanging_lookup(*args: object, **kwargs: object) -> list:
        release.wait(30)
        return []

    monkeypatch.setattr("app.media_fetch.socket.getaddrinfo", hanging_lookup)
    began = time.monotonic()
    try:
        with pytest.raises(APIError) as err:
            load_images(
                [ImageSource(url="http://slow-dns.example.com/cat.png")],
                ImageLimits(fetch_timeout=0.5, fetch_private_urls=True),
            )
    finally:
        release.set()
    assert time.monotonic() - began < 3
    assert err.value.status == 400 and "--fetch-timeout" in err.value.message


def test_allowed_domain_patterns_match_hosts_exactly_or_by_subdomain():
    policy = FetchPolicy(allowed_domains=("Example.com", "*.cdn.example.org"))
    assert policy.allows("example.com") and policy.allows("EXAMPLE.COM.")
    assert policy.allows("a.cdn.example.org") and policy.allows("a.b.cdn.example.org")
    assert not policy.allows("cdn.example.org")  # the wildcard names subdomains only
    assert not policy.allows("evilexample.com") and not policy.allows("a.example.com")
    assert not policy.allows("x.evilcdn.example.org")
    assert FetchPolicy().allows("anything.at.all")


def test_the_allowed_media_domains_setting_reaches_the_image_limits():
    from app.settings import Settings

    limits = Settings(_env_file=None, allowed_media_domains=" a.com, *.b.org ,").image_limits
    assert limits.allowed_media_domains == ("a.com", "*.b.org")
    assert Settings(_env_file=None).image_limits.allowed_media_domains == ()


def test_an_anthropic_url_image_source_is_fetched():
    from app.images import source_of

    part = {"type": "image", "source": {"type": "url", "url": ""}}
    with http_server(png()) as url:
        part["source"]["url"] = url
        ((image,),) = load_images(
            [source_of(part, "messages.0.content.0")], ImageLimits(fetch_private_urls=True)
        )
    assert image.image.size == (3, 2)


def test_a_local_use_nat64_address_of_a_public_ipv4_one_is_fetched_with_the_flag(monkeypatch):
    """RFC 8215's prefix is not globally reachable, and which IPv4 address it stands
    for depends on the operator's prefix length: only with --fetch-private-urls,
    and then not refused for what a shorter layout misreads (0.0.0.0)."""
    connects = resolving_to(monkeypatch, "64:ff9b:1::5db8:d822")  # 93.184.216.34 in a /96
    with pytest.raises(APIError) as err:  # the connection goes nowhere in this test
        load_images(
            [ImageSource(url="http://images.example.com/cat.png")],
            ImageLimits(fetch_private_urls=True),
        )
    assert "does not fetch from such addresses" not in err.value.message
    assert len(connects) == 1


def test_a_video_waiting_too_long_for_a_decoder_is_a_503_not_its_own_fault():
    """The wait for the decoder counted against the video's own deadline: a good
    video queued behind others was refused as "took too long" (a 400)."""

    async def scenario() -> None:
        preparer = Preparer(threads=2, media_waits=4, decoders=1)
        holding, release = threading.Event(), threading.Event()

        def first() -> str:
            with decoder_wait(5.0):
                holding.set()
                release.wait(10)
            return "decoded"

        def second() -> str:
            with decoder_wait(0.3):
                return "never"

        slow = asyncio.ensure_future(preparer.run(first))
        while not holding.is_set():
            await asyncio.sleep(0.01)
        with pytest.raises(APIError) as err:
            await asyncio.wait_for(preparer.run(second), 5)
        assert err.value.status == 503 and err.value.code == "media_busy"
        release.set()
        assert await asyncio.wait_for(slow, 5) == "decoded"

    asyncio.run(scenario())


def test_no_image_is_decoded_while_a_later_source_is_still_being_fetched(monkeypatch):
    """Each source was fetched and decoded in turn: a request's decoded images
    (0.9 GB for a few 40 MP pictures) stayed in memory while a later URL
    downloaded or a video waited for ffmpeg, with its CPU slot given up: eight
    such waits held gigabytes outside every budget. Every source's bytes come
    first; only then is anything decoded."""
    import base64

    import app.images as images
    import app.video_frames as video_frames

    decoded: list[str] = []
    waits: list[tuple[str, int]] = []  # (what waited, images decoded by then)
    decode = images.decode_image

    def decoding(raw: bytes, limits: ImageLimits, where: str = "image"):
        decoded.append(where)
        return decode(raw, limits, where)

    def fetched(url, policy, max_bytes, where):
        waits.append((f"fetch {where}", len(decoded)))
        return png()

    def frames(raw, n, timeout, max_pixels=None, where="video"):
        waits.append((f"ffmpeg {where}", len(decoded)))
        return [png(), png()]

    monkeypatch.setattr(images, "decode_image", decoding)
    monkeypatch.setattr(images, "fetch", fetched)
    monkeypatch.setattr(video_frames, "extract_frames", frames)
    inline = ImageSource(base64=base64.b64encode(png()).decode())
    video = ImageSource(
        url="data:video/mp4;base64," + base64.b64encode(b"clip").decode(), video=True
    )
    sources = [inline, ImageSource(url="https://example.com/a.png"), video, inline]
    loaded = load_images(sources, ImageLimits())
    assert [len(x) for x in loaded] == [1, 1, 2, 1]
    assert waits == [("fetch image 2", 0), ("ffmpeg video 3", 0)]
    assert decoded == ["image 1", "image 2", "video 3 frame 1", "video 3 frame 2", "image 4"]
