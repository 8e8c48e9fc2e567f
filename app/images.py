"""Images from any dialect, decoded once at the boundary (worker thread).

Each dialect names an image its own way (chat ``image_url``, Anthropic
``source``, Responses ``input_image``); all become an ``ImageSource``. Loading
one enforces every limit before the next costly step: the encoded size before
base64 decoding or while downloading, the pixel count from the header before
any pixel is decoded. The identity of an image is a digest of its decoded
pixels, so the same picture re-encoded (another PNG compressor, a data URL
instead of a file) is the same image to the cache.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from app.errors import APIError
from app.media_fetch import FetchPolicy, fetch

# the formats a client's bytes may be decoded as: what browsers and agents send
# (never EPS/PDF, which Pillow hands to Ghostscript, or other exotic decoders;
# nor TIFF, whose uncompressed strips Pillow decodes one by one in Python: a
# 19 MB file of 2.4M one-row strips cost 15 s and 1 GB of a preparation slot)
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
# a progressive JPEG's decoder passes over the whole image once a scan: encoders
# write about ten, a crafted file thousands in a few KB (minutes of a preparation
# slot every request shares). Markers inside an EXIF thumbnail count too: still few.
MAX_JPEG_SCANS = 100
# before the first scan Pillow's JPEG header parser reads each segment and each
# stray byte in Python: 6 MB of empty APP segments cost 1.8 s and 197 MiB for an
# 8x8 image. Encoders write a few dozen segments, and no stray bytes.
MAX_JPEG_SEGMENTS = 256  # before any one scan (fill bytes and 0xFF00 pairs count)
MAX_JPEG_STRAY = 64 * 1024  # bytes outside any segment, all told
# the marker that ends a scan's entropy-coded data: 0xFF not before a stuffed
# 0x00, a restart marker or a fill byte (searched in C: a Python loop per
# 0xFF00 pair cost 0.55 s for 10 MB of them)
_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
# Pillow reads a PNG's chunks, and a GIF's extension sub-blocks and stray bytes
# before its first image, one at a time in Python holding the GIL: 10 MB of empty
# PNG chunks cost 3.5 s. Files hold a few dozen, or libpng's 8 KiB IDAT chunks:
# this many are read, or one a KiB in a larger file.
MAX_BLOCKS = 4096
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[^;,]*)*)(;base64)?,", re.I)


@dataclass(frozen=True)
class ImageLimits:
    """The seed servers' limits, all settable (--max-images etc.)."""

    max_images: int = 5
    max_image_bytes: int = 20 * 10**6
    max_total_bytes: int = 50 * 10**6
    max_pixels: int = 40_000_000  # decompression-bomb guard, from the header
    fetch_urls: bool = True
    fetch_timeout: float = 10.0
    allowed_media_domains: tuple[str, ...] = ()  # hosts URLs may name; empty: any
    fetch_private_urls: bool = False  # loopback and private addresses too
    video_frames: int = 8  # frames a video part becomes (0: videos refused)
    max_video_bytes: int = 50 * 10**6  # and within max_total_bytes with the images
    video_timeout: float = 30.0  # ffmpeg's time to read one video's frames


@dataclass(frozen=True)
class ImageSource:
    """Where an image's bytes are: a URL (data: or http(s)) or inline base64.
    A video's are read as frames (app.video_frames)."""

    url: str | None = None
    base64: str | None = None
    video: bool = False


@dataclass(frozen=True)
class LoadedImage:
    """One decoded image: RGB pixels and the digest that names them."""

    image: Any  # PIL.Image.Image in RGB
    digest: bytes

    @property
    def short_id(self) -> str:
        return self.digest.hex()[:12]


def source_of(part: dict[str, Any], where: str) -> ImageSource:
    """The ``ImageSource`` of one content part of any dialect."""
    kind = part.get("type")
    if kind == "image_url":  # chat completions
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if isinstance(url, str):
            return ImageSource(url=url)
    elif kind == "video_url":  # chat completions (vLLM's extension)
        ref = part.get("video_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if isinstance(url, str):
            return ImageSource(url=url, video=True)
    elif kind == "input_image":  # Responses
        url = part.get("image_url")
        if isinstance(url, str):
            return ImageSource(url=url)
        if part.get("file_id") is not None:
            raise APIError(
                400, "input_image by file_id is not supported: send image_url", param=where
            )
    elif kind == "image":  # Anthropic
        src = part.get("source")
        if isinstance(src, dict) and src.get("type") == "base64":
            if isinstance(src.get("data"), str):
                return ImageSource(base64=src["data"])
        if isinstance(src, dict) and src.get("type") == "url" and isinstance(src.get("url"), str):
            return ImageSource(url=src["url"])
    raise APIError(400, f"{kind} content has no image URL or base64 data.", param=where)


def check_count(n: int, limits: ImageLimits, where: str = "messages") -> None:
    if n > limits.max_images:
        raise APIError(
            400,
            f"Too many images: {n} in this request; the limit is {limits.max_images} "
            "(--max-images).",
            param=where,
        )


def load_images(
    sources: list[ImageSource], limits: ImageLimits, fields: Sequence[str] | None = None
) -> list[list[LoadedImage]]:
    """Every image of one request, decoded, within the request's limits: one
    image per source, a video's frames for a video. Every source's bytes come
    first (downloads, ffmpeg's frames), then all are decoded: those waits give
    the CPU slot up, and a request's pixels decoded before one (a few 40 MP
    pictures are a GB) stayed in memory through it, outside every budget.
    ``fields``: the request field holding each source, named by its refusals."""
    named: list[str | None] = list(fields) if fields is not None else [None] * len(sources)
    if len(sources) > limits.max_images:
        check_count(len(sources), limits, named[limits.max_images] or "messages")
    encoded = _all_encoded(sources, limits, named)
    out = []
    for frames, field in zip(encoded, named):
        with _naming(field):
            out.append([decode_image(raw, limits, where) for raw, where in frames])
    return out


@contextmanager
def _naming(field: str | None) -> Iterator[None]:
    """A source's refusals (app.media_fetch's and app.video_frames' too, which
    know it only as "image N") name the request field holding it."""
    try:
        yield
    except APIError as exc:
        if field is None or exc.status != 400 or exc.param is not None:
            raise
        raise APIError(400, exc.message, exc.error_type, exc.code, field, exc.headers) from exc


def _all_encoded(
    sources: list[ImageSource], limits: ImageLimits, fields: Sequence[str | None]
) -> list[list[tuple[bytes, str]]]:
    """Each source's encoded images and the names their errors give: one for an
    image, a video's frames (as PNG) for a video."""
    out: list[list[tuple[bytes, str]]] = []
    total = 0
    for i, (source, field) in enumerate(zip(sources, fields)):
        where = f"{'video' if source.video else 'image'} {i + 1}"
        with _naming(field):
            if source.video and limits.video_frames <= 0:
                raise APIError(
                    400, f"{where}: this server does not read videos (--video-frames 0)."
                )
            raw = _encoded(source, limits, where, limits.max_total_bytes - total)
            total += len(raw)  # a video's bytes count too: one budget a request
            if total > limits.max_total_bytes:
                raise APIError(
                    400,
                    f"Images too large in total: {total} bytes so far; the limit is "
                    f"{limits.max_total_bytes} bytes a request (--max-images-bytes).",
                )
            out.append(_frames(raw, limits, where) if source.video else [(raw, where)])
    return out


def _frames(raw: bytes, limits: ImageLimits, where: str) -> list[tuple[bytes, str]]:
    from app.video_frames import extract_frames

    frames = extract_frames(
        raw, limits.video_frames, limits.video_timeout, limits.max_pixels, where
    )
    return [(f, f"{where} frame {j + 1}") for j, f in enumerate(frames)]


def decode_image(raw: bytes, limits: ImageLimits, where: str = "image") -> LoadedImage:
    from PIL import Image, ImageOps

    refusal = _structure_refusal(raw)
    if refusal:
        raise APIError(400, f"{where}: {refusal}; it is not read.")
    try:
        image = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
        width, height = image.size  # the header only: nothing decoded yet
    except MemoryError:
        raise
    except Image.UnidentifiedImageError as exc:
        raise APIError(
            400, f"{where}: not an image this server can read (PNG, JPEG, GIF, WEBP or BMP)."
        ) from exc
    except Exception as exc:  # noqa: BLE001 - whatever a crafted header raises
        raise APIError(400, f"{where}: not an image this server can read ({exc}).") from exc
    if width * height > limits.max_pixels:
        raise APIError(
            400,
            f"{where}: {width}x{height} = {width * height} pixels; the limit is "
            f"{limits.max_pixels} (--max-image-pixels).",
        )
    # Pillow's RLE BMP decoder is Python, a loop a pixel: 4 KB of end-of-line
    # escapes over 40M pixels cost 6 s, holding the GIL the engine thread needs
    if image.format == "BMP" and any(tile[0] == "bmp_rle" for tile in image.tile):
        raise APIError(400, f"{where}: an RLE-compressed BMP is not read; send PNG or JPEG.")
    try:
        _upright(image, ImageOps)
        if image.mode.startswith("I;16"):  # 16-bit grey: convert() clips it, near white
            import numpy as np

            image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
        rgb = image.convert("RGB")  # decodes: corrupt data fails here
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a crafted file raises what its decoder does
        raise APIError(400, f"{where}: the image data is corrupt ({exc}).") from exc
    width, height = rgb.size
    digest = hashlib.blake2b(f"{width}x{height}".encode(), digest_size=16)
    digest.update(rgb.tobytes())
    return LoadedImage(rgb, digest.digest())


def _upright(image: Any, image_ops: Any) -> None:
    """A phone's portrait photo is stored sideways with an EXIF orientation: the
    model sees it upright, as mlx-vlm's own loader shows it. An unreadable EXIF
    block leaves the picture as stored (the pixels may be fine)."""
    try:
        orientation = image.getexif().get(0x0112, 1)
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - whatever a malformed EXIF block raises
        return
    if orientation != 1:
        image_ops.exif_transpose(image, in_place=True)


def _structure_refusal(raw: bytes) -> str | None:
    """Why the file is not handed to Pillow, or None: what its parser would walk
    in Python, walked first in bytes, linearly and within the limits above. An
    MPO (a phone's multi-picture JPEG) opens as JPEG too, and decodes its first
    picture."""
    if raw[:3] == b"\xff\xd8\xff":
        refusal = _jpeg_refusal(raw)
        return f"a JPEG of {refusal}" if refusal else None
    cap = max(MAX_BLOCKS, len(raw) // 1024)
    if raw[:8] == b"\x89PNG\r\n\x1a\n" and _png_chunks(raw, cap) > cap:
        return f"a PNG of more than {cap} chunks"
    if raw[:6] in (b"GIF87a", b"GIF89a") and _gif_blocks(raw, cap) > cap:
        return f"a GIF of more than {cap} blocks before its image"
    return None


def _png_chunks(raw: bytes, cap: int) -> int:
    """The PNG chunks Pillow reads, counted to one past ``cap``: to the end
    (IEND), or for an animation to its second frame (fcTL after the image data:
    Pillow stops there, only the first frame is read). An APNG of thousands of
    small frames was refused."""
    chunks, pos = 0, 8  # after the signature
    animated = image_seen = False
    while pos + 8 <= len(raw) and chunks <= cap:
        kind = raw[pos + 4 : pos + 8]
        if kind == b"IEND" or (kind == b"fcTL" and animated and image_seen):
            return chunks + 1
        chunks += 1
        length = int.from_bytes(raw[pos : pos + 4], "big")
        if kind == b"acTL":  # frames > 1: what Pillow calls animated
            animated = int.from_bytes(raw[pos + 8 : pos + 12], "big") > 1
        image_seen = image_seen or kind == b"IDAT"
        pos += 12 + length  # length, type, data, CRC
    return chunks


def _gif_blocks(raw: bytes, cap: int) -> int:
    """The extension sub-blocks and stray bytes ahead of a GIF's first image
    (whose data Pillow's C decoder reads), counted to one past ``cap``."""
    flags = raw[10] if len(raw) > 10 else 0
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # after the global palette
    blocks = 0
    while pos < len(raw) and blocks <= cap and raw[pos] not in b",;":  # an image, the end
        blocks += 1
        if raw[pos] != 0x21:  # a stray byte: skipped
            pos += 1
            continue
        pos += 2  # "!" and the extension's label
        while pos < len(raw) and blocks <= cap:  # its sub-blocks, to an empty one
            blocks += 1
            size = raw[pos]
            pos += 1 + size
            if not size:
                break
    return blocks


def _jpeg_refusal(raw: bytes) -> str | None:
    """Why a JPEG's first picture is not decoded (too many scans, segments or
    stray bytes), or None. Walked marker by marker to its end (EOI): what an APP
    segment holds (an EXIF thumbnail) and what follows the picture (a motion
    photo's video) is not counted. Between segments it skips what libjpeg skips
    (stray bytes, fill bytes, a 0xFF00 pair): stopping there, one junk byte hid
    thousands of scans the decoder then ran. Every step is bounded by a limit."""
    scans, segments, stray, pos, n = 0, 0, 0, 2, len(raw)  # after SOI
    while (at := raw.find(b"\xff", pos)) >= 0 and at + 1 < n:
        stray += at - pos
        segments += 1
        if stray > MAX_JPEG_STRAY:
            return f"more than {MAX_JPEG_STRAY} stray bytes between its segments"
        if segments > MAX_JPEG_SEGMENTS:
            return f"more than {MAX_JPEG_SEGMENTS} segments before a scan"
        marker = raw[at + 1]
        if marker == 0xD9:  # EOI
            break
        if marker == 0xFF:  # a fill byte before the marker
            pos = at + 1
        elif marker == 0x00 or marker == 0x01 or 0xD0 <= marker <= 0xD7:  # no length
            pos = at + 2
        else:
            pos = at + 2 + int.from_bytes(raw[at + 2 : at + 4], "big")
        if marker != 0xDA:
            continue
        scans += 1
        if scans > MAX_JPEG_SCANS:
            return f"more than {MAX_JPEG_SCANS} scans (each one a pass over the whole image)"
        segments = 0
        if (end := _SCAN_END.search(raw, pos)) is None:  # past its entropy-coded data
            break
        pos = end.start()
    return None


@dataclass(frozen=True)
class _Cap:
    """The size limit one source is read under."""

    nbytes: int
    what: str  # "an image" / "a video"
    flag: str


def _cap(source: ImageSource, limits: ImageLimits) -> _Cap:
    if source.video:
        return _Cap(limits.max_video_bytes, "a video", "--max-video-bytes")
    return _Cap(limits.max_image_bytes, "an image", "--max-image-bytes")


def _too_big(n: int, cap: _Cap, where: str) -> APIError:
    return APIError(
        400, f"{where}: {n} bytes; the limit is {cap.nbytes} bytes {cap.what} ({cap.flag})."
    )


def _b64(data: str, cap: _Cap, where: str) -> bytes:
    if len(data) * 3 // 4 > cap.nbytes + 3:
        raise _too_big(len(data) * 3 // 4, cap, where)
    try:
        raw = base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError) as exc:
        raise APIError(400, f"{where}: invalid base64 data ({exc}).") from exc
    if len(raw) > cap.nbytes:
        raise _too_big(len(raw), cap, where)
    return raw


def _encoded(source: ImageSource, limits: ImageLimits, where: str, room: int) -> bytes:
    """The source's bytes; a download stops one byte past ``room``, what the
    request's total has left (the caller then names that limit)."""
    cap = _cap(source, limits)
    if source.base64 is not None:
        return _b64(source.base64, cap, where)
    url = source.url or ""
    match = _DATA_URL.match(url)
    if match:
        if not match.group(3):
            raise APIError(400, f"{where}: a data URL must be base64 encoded.")
        return _b64(url[match.end() :], cap, where)
    if url[:8].lower().startswith(("http://", "https://")):
        if not limits.fetch_urls:
            raise APIError(
                400,
                f"{where}: this server does not fetch URLs (--no-fetch-urls); send "
                "the data as a data URL or base64.",
            )
        policy = FetchPolicy(
            limits.fetch_timeout, limits.allowed_media_domains, limits.fetch_private_urls
        )
        raw = fetch(url, policy, min(cap.nbytes, room), where)
        if len(raw) > cap.nbytes:
            raise _too_big(len(raw), cap, where)
        return raw
    raise APIError(400, f"{where}: URLs must be data:, http: or https: URLs.")
