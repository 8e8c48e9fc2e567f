"""Client image bytes are decoded only as the formats agents send."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from app.errors import APIError
from app.image_prompt import ResolvedImages, attach_images, resolve_images
from app.images import IMAGE_FORMATS, ImageLimits, decode_image
from kvcache.prompt_key import PromptKey


@pytest.mark.parametrize("fmt", IMAGE_FORMATS)
def test_common_formats_decode_to_the_same_pixels_identity(fmt):
    buf = io.BytesIO()
    Image.new("RGB", (6, 4), (10, 20, 30)).save(buf, format=fmt)
    loaded = decode_image(buf.getvalue(), ImageLimits())
    assert loaded.image.size == (6, 4) and loaded.image.mode == "RGB"


def test_postscript_is_never_handed_to_a_decoder():
    """EPS would reach Ghostscript through Pillow: refused as not an image."""
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(APIError) as err:
        decode_image(eps, ImageLimits())
    assert err.value.status == 400 and "not an image" in err.value.message


def test_images_over_the_requests_total_bytes_are_refused_naming_the_limit():
    import base64

    from app.images import ImageSource, load_images

    buf = io.BytesIO()
    Image.new("RGB", (6, 4), (10, 20, 30)).save(buf, format="PNG")
    raw = buf.getvalue()
    source = ImageSource(base64=base64.b64encode(raw).decode())
    limits = ImageLimits(max_total_bytes=2 * len(raw))
    assert len(load_images([source, source], limits)) == 2
    with pytest.raises(APIError) as err:
        load_images([source, source, source], limits)
    assert err.value.status == 400 and "--max-images-bytes" in err.value.message
    assert f"{3 * len(raw)} bytes" in err.value.message


class _Front:
    placeholder = "<|vision_start|><image><|vision_end|>"
    image_token = "<image>"
    markers = ("<|vision_start|>", "<image>", "<|vision_end|>")
    placeholder_id = 7


@pytest.mark.parametrize(
    "content",
    ["a <image> here", [{"type": "text", "text": "a <image> here"}]],
)
def test_the_image_marker_in_text_is_kept_as_text(content):
    """Refused (400), a tool result holding an RSS feed's <image> left the agent's
    whole conversation unservable; kept as a token, the model read image tokens
    with no image behind them. It is the characters it is, in every role."""
    messages = [
        {"role": "assistant", "content": "<|vision_end|> x"},
        {"role": "tool", "content": content},
    ]
    out, resolved = resolve_images(messages, _Front(), ImageLimits(), placeholder_notes=False)
    assert not resolved.images
    assert out[0]["content"] == "<\u2060|vision_end|> x"
    tool = out[1]["content"]
    assert (tool if isinstance(tool, str) else tool[0]["text"]) == "a <\u2060image> here"
    fine = [{"role": "user", "content": "a picture, please"}]
    assert resolve_images(fine, _Front(), ImageLimits(), placeholder_notes=False)[0] == fine


def test_the_image_marker_rendered_from_outside_message_text_is_refused():
    """Reasoning, tool-call arguments and tool definitions are rendered too: the
    marker there became an image token with no image behind it."""
    forged = PromptKey.build([1, 2, _Front.placeholder_id, 3, 4])
    with pytest.raises(APIError) as err:
        attach_images(forged, ResolvedImages(), _Front())
    assert err.value.status == 400 and "'<image>'" in err.value.message
    clean = PromptKey.build([1, 2, 3, 4])
    assert attach_images(clean, ResolvedImages(), _Front()) == (clean, [1, 2, 3, 4], ())


def _progressive_jpeg(extra_scans: int) -> bytes:
    """A progressive JPEG with its last scan written ``extra_scans`` more times
    (each a pass over the whole image for the decoder, a few bytes in the file)."""
    out = io.BytesIO()
    Image.new("L", (256, 256), 128).save(out, "JPEG", progressive=True)
    data = out.getvalue()
    last = data.rindex(b"\xff\xda")
    eoi = data.rindex(b"\xff\xd9")
    return data[:eoi] + data[last:eoi] * extra_scans + data[eoi:]


def test_a_jpeg_of_thousands_of_scans_is_refused_before_it_is_decoded():
    """5000 repeated scans in 86 KB took a preparation slot (one of two, shared by
    every request) 1.6 s at 2000x2000, minutes at the byte limit."""
    assert decode_image(_progressive_jpeg(0), ImageLimits()).image.size == (256, 256)
    with pytest.raises(APIError, match="a JPEG of more than 100 scans") as refused:
        decode_image(_progressive_jpeg(5000), ImageLimits())
    assert refused.value.status == 400


def test_an_mpo_of_thousands_of_scans_is_refused_too():
    """A phone's multi-picture JPEG opens as MPO and decodes its first picture:
    the JPEG-only check let the same scans through in a few more header bytes."""
    first = Image.new("L", (256, 256), 128)
    out = io.BytesIO()
    first.save(out, "MPO", save_all=True, append_images=[first], progressive=True)
    data = out.getvalue()
    eoi = data.index(b"\xff\xd9")  # the first picture's end
    last = data.rindex(b"\xff\xda", 0, eoi)
    crafted = data[:eoi] + data[last:eoi] * 5000 + data[eoi:]
    assert Image.open(io.BytesIO(crafted)).format == "MPO"
    with pytest.raises(APIError, match="scans"):
        decode_image(crafted, ImageLimits())


def test_what_follows_a_jpeg_or_sits_in_its_app_segments_is_no_scan():
    """A raw byte count read a motion photo's trailing video (0xFF 0xDA every ~64
    KiB of it) as scans and refused ordinary phone photos."""
    exif = Image.Exif()
    exif[0x010E] = "\xff\xda" * 200  # ImageDescription: the marker bytes in an APP1 segment
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (1, 2, 3)).save(out, "JPEG", exif=exif)
    video = b"\x00\x00\x00\x18ftypmp42" + b"\xff\xda\x12\x34" * 500
    assert decode_image(out.getvalue() + video, ImageLimits()).image.size == (64, 48)


# Pillow's TIFF of a 9x9 16-bit image with its StripOffsets tag typed RATIONAL:
# the decoder raises TypeError, which was a 500
BAD_TIFF = bytes.fromhex(
    "49492a00080000000900000104000100000009000000010104000100000009000000020103000100"
    "00001000000003010300010000000100000006010300010000000100000011010500010000007a00"
    "00001601040001000000090000001701040001000000a20000001c010300010000000100000000"
) + bytes(140)


def test_a_corrupt_image_whose_decoder_raises_anything_is_a_400(monkeypatch):
    # that TIFF (TypeError in its decoder, a 500 once) is no longer read at all
    with pytest.raises(APIError, match="can read") as refused:
        decode_image(BAD_TIFF, ImageLimits())
    assert refused.value.status == 400
    # a decoder of a format still read raising what it likes: a 400 too
    buf = io.BytesIO()
    Image.new("RGB", (6, 4)).save(buf, format="PNG")

    def crafted(*_args, **_kwargs):
        raise TypeError("a crafted file's decoder fault")

    monkeypatch.setattr(Image.Image, "convert", crafted)
    with pytest.raises(APIError, match="corrupt") as refused:
        decode_image(buf.getvalue(), ImageLimits())
    assert refused.value.status == 400


@pytest.mark.parametrize("junk", [b"\x00", b"\xff\x00", b"\xff\x00\xff\xff"])
def test_a_junk_byte_between_segments_hides_no_scans(junk):
    """The walker stopped at the first byte that was no marker, counting none of
    the scans libjpeg (skipping the junk) then decoded: 13 s for 86 KB."""
    bomb = _progressive_jpeg(500)
    after_app0 = 4 + int.from_bytes(bomb[4:6], "big")
    crafted = bomb[:after_app0] + junk + bomb[after_app0:]
    Image.open(io.BytesIO(crafted)).load()  # what the decoder does with it: reads every scan
    with pytest.raises(APIError, match="scans"):
        decode_image(crafted, ImageLimits())


def _rle8_bmp(width: int, rows: bytes, height: int) -> bytes:
    import struct

    palette = b"\x00\x00\x00\x00\xff\xff\xff\x00"
    data = rows + b"\x00\x01"  # end of bitmap
    offset = 14 + 40 + len(palette)
    header = b"BM" + struct.pack("<IHHI", offset + len(data), 0, 0, offset)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(data), 2835, 2835, 2, 0)
    return header + info + palette + data


def test_an_rle_bmp_is_refused_before_its_python_decoder_runs():
    """4 KB of end-of-line escapes over 40M pixels: 6 s in Pillow's Python RLE loop."""
    raw = _rle8_bmp(40_000, b"\x01\x01\x00\x00" * 1000, 1000)
    assert Image.open(io.BytesIO(raw)).tile[0][0] == "bmp_rle"
    with pytest.raises(APIError, match="RLE") as refused:
        decode_image(raw, ImageLimits())
    assert refused.value.status == 400


def test_tiff_is_not_read():
    """Uncompressed strips decode one by one in Python: 2.4M one-row strips in
    19 MB cost 15 s and 1 GB."""
    buf = io.BytesIO()
    Image.new("RGB", (6, 4)).save(buf, format="TIFF")
    with pytest.raises(APIError, match="PNG, JPEG") as refused:
        decode_image(buf.getvalue(), ImageLimits())
    assert refused.value.status == 400


def test_a_photo_with_an_exif_orientation_reaches_the_model_upright():
    """Phones store portrait photos sideways and say so in EXIF: the model was
    handed the sideways pixels (mlx-vlm's own loader turns them)."""
    sideways = Image.new("RGB", (60, 40), (255, 0, 0))
    sideways.paste((0, 0, 255), (0, 0, 30, 40))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    sideways.save(buf, "JPEG", exif=exif, quality=95)
    loaded = decode_image(buf.getvalue(), ImageLimits())
    assert loaded.image.size == (40, 60)
    red, blue = loaded.image.getpixel((20, 55)), loaded.image.getpixel((20, 5))
    assert red[0] > 200 > red[2] and blue[2] > 200 > blue[0]


def test_a_url_scheme_in_capitals_is_still_a_url():
    from app.images import ImageSource, load_images

    with pytest.raises(APIError, match="does not fetch URLs"):
        load_images([ImageSource(url="HTTPS://example.com/a.png")], ImageLimits(fetch_urls=False))


def _small_jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(out, "JPEG")
    return out.getvalue()


def _opens_counted(monkeypatch) -> list[int]:
    """Every Image.open decode_image makes, counted (a refusal made first makes none)."""
    opened: list[int] = []
    real_open = Image.open

    def counted(*args, **kwargs):
        opened.append(1)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(Image, "open", counted)
    return opened


def test_a_jpeg_of_thousands_of_empty_segments_is_refused_before_pillow_parses_it(monkeypatch):
    """Pillow's header parser reads every segment before the first scan in Python:
    6 MB of empty APP3 segments cost 1.8 s and 197 MiB for an 8x8 image."""
    plain = _small_jpeg()
    opened = _opens_counted(monkeypatch)
    some = plain[:2] + b"\xff\xe3\x00\x02" * 200 + plain[2:]  # still a few hundred: read
    assert decode_image(some, ImageLimits()).image.size == (8, 8) and opened
    opened.clear()
    stuffed = plain[:2] + b"\xff\xe3\x00\x02" * 100_000 + plain[2:]
    with pytest.raises(APIError, match="more than 256 segments before a scan") as refused:
        decode_image(stuffed, ImageLimits())
    assert refused.value.status == 400 and not opened


def test_a_jpeg_of_many_stray_bytes_between_segments_is_refused(monkeypatch):
    """Pillow skips stray bytes one at a time in Python (10 MB: 0.4 s)."""
    plain = _small_jpeg()
    after_app0 = 4 + int.from_bytes(plain[4:6], "big")
    opened = _opens_counted(monkeypatch)
    some = plain[:after_app0] + bytes(100) + plain[after_app0:]
    assert decode_image(some, ImageLimits()).image.size == (8, 8)
    opened.clear()
    flood = plain[:after_app0] + bytes(10**6) + plain[after_app0:]
    with pytest.raises(APIError, match="stray bytes") as refused:
        decode_image(flood, ImageLimits())
    assert refused.value.status == 400 and not opened


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    import struct
    import zlib

    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_rechunked(image: Image.Image, idat_size: int, extra: bytes = b"") -> bytes:
    """``image`` as Pillow writes it, its pixel data cut into IDAT chunks of
    ``idat_size`` bytes and ``extra`` chunks put after its header."""
    out = io.BytesIO()
    image.save(out, "PNG", compress_level=0)
    raw = out.getvalue()
    pos, idat, head = 8, b"", b""
    while pos < len(raw):
        size = int.from_bytes(raw[pos : pos + 4], "big")
        kind = raw[pos + 4 : pos + 8]
        if kind == b"IDAT":
            idat += raw[pos + 8 : pos + 8 + size]
        elif kind != b"IEND":
            head += raw[pos : pos + 12 + size]
        pos += 12 + size
    pieces = [idat[i : i + idat_size] for i in range(0, len(idat), idat_size)]
    return (
        raw[:8]
        + head
        + extra
        + b"".join(_png_chunk(b"IDAT", p) for p in pieces)
        + _png_chunk(b"IEND", b"")
    )


def test_a_png_of_thousands_of_tiny_chunks_is_refused_before_pillow_parses_it(monkeypatch):
    """Pillow reads each chunk in Python, holding the GIL: 10 MB of empty
    ancillary chunks cost 3.5 s for an 8x8 image, tiny IDAT chunks the same."""
    small = Image.new("RGB", (8, 8), (10, 20, 30))
    opened = _opens_counted(monkeypatch)
    some = _png_rechunked(small, 8192, _png_chunk(b"zzZz", b"") * 1000)
    assert decode_image(some, ImageLimits()).image.size == (8, 8) and opened
    opened.clear()
    for crafted in (
        _png_rechunked(small, 8192, _png_chunk(b"zzZz", b"") * 10_000),
        _png_rechunked(Image.new("RGB", (64, 64)), 1),  # 12 KB of one-byte IDAT chunks
    ):
        with pytest.raises(APIError, match="a PNG of more than 4096 chunks") as refused:
            decode_image(crafted, ImageLimits())
        assert refused.value.status == 400 and not opened


def test_an_animated_png_of_thousands_of_frames_is_read_to_its_first(monkeypatch):
    """Pillow reads an APNG's chunks only up to its second frame: counted to the
    end, 2,200 small frames were refused. Chunks that come after a still image's
    data are read all the same, so there an fcTL ends nothing."""
    frames = [Image.new("RGB", (8, 8), (i % 256, 0, 0)) for i in range(2200)]
    out = io.BytesIO()
    frames[0].save(out, "PNG", save_all=True, append_images=frames[1:], duration=33)
    assert decode_image(out.getvalue(), ImageLimits()).image.getpixel((0, 0)) == (0, 0, 0)
    still = _png_rechunked(Image.new("RGB", (8, 8)), 8192)
    tail = _png_chunk(b"fcTL", bytes(26)) + _png_chunk(b"zzZz", b"") * 10_000
    crafted = still[: -len(_png_chunk(b"IEND", b""))] + tail + _png_chunk(b"IEND", b"")
    opened = _opens_counted(monkeypatch)
    with pytest.raises(APIError, match="a PNG of more than 4096 chunks"):
        decode_image(crafted, ImageLimits())
    assert not opened


def test_a_large_png_of_many_ordinary_chunks_is_still_read():
    """A large PNG holds thousands of libpng's 8 KiB IDAT chunks: allowed one a KiB."""
    noise = Image.frombytes("L", (2300, 2300), bytes(range(256)) * 20_665)
    raw = _png_rechunked(noise, 1024)
    assert raw.count(b"IDAT") > 5000
    assert decode_image(raw, ImageLimits()).image.size == (2300, 2300)


def _gif_with(before_image: bytes) -> bytes:
    """An 8x8 GIF with ``before_image`` (extensions, or anything) ahead of its image."""
    out = io.BytesIO()
    Image.new("P", (8, 8)).save(out, "GIF")
    raw = out.getvalue()
    image = raw.index(b",", 13 + 3 * 2 ** ((raw[10] & 7) + 1) if raw[10] & 0x80 else 13)
    return raw[:image] + before_image + raw[image:]


def test_a_gif_of_thousands_of_extension_blocks_is_refused_before_pillow_parses_it(monkeypatch):
    """Pillow reads a GIF's extension sub-blocks and any stray byte before its
    first image one at a time in Python: 0.09 s a MB of one-byte sub-blocks."""
    opened = _opens_counted(monkeypatch)
    comment = b"!\xfe" + b"\xffc" + b"c" * 254 + b"\x00"  # a 255-byte sub-block
    assert decode_image(_gif_with(comment * 100), ImageLimits()).image.size == (8, 8)
    opened.clear()
    for crafted in (b"!\xfe" + b"\x01c" * 10_000 + b"\x00", b"\x00" * 10_000):
        with pytest.raises(APIError, match="a GIF of more than 4096 blocks") as refused:
            decode_image(_gif_with(crafted), ImageLimits())
        assert refused.value.status == 400 and not opened


def test_a_url_is_read_no_further_than_the_requests_total_bytes_left(monkeypatch):
    """A URL was read up to the per-image limit (20 MB) even with a few bytes of
    the request's total left: the total's refusal came after the download."""
    import base64

    import app.images as images
    from app.images import ImageSource, load_images

    buf = io.BytesIO()
    Image.new("RGB", (6, 4)).save(buf, format="PNG")
    raw = buf.getvalue()
    asked: list[int] = []

    def fetched(url, policy, max_bytes, where):
        asked.append(max_bytes)
        return b"x" * (max_bytes + 1)  # a body longer than it may be: read one past

    monkeypatch.setattr(images, "fetch", fetched)
    inline = ImageSource(base64=base64.b64encode(raw).decode())
    limits = ImageLimits(max_total_bytes=len(raw) + 100)
    with pytest.raises(APIError, match="--max-images-bytes") as refused:
        load_images([inline, ImageSource(url="https://example.com/a.png")], limits)
    assert refused.value.status == 400 and asked == [100]


def test_a_16_bit_grayscale_png_keeps_its_greys():
    """Pillow opens it as I;16, whose convert("RGB") clips every value over 255:
    a mid-grey picture reached the model near white."""
    import numpy as np

    grey = np.full((4, 6), 0x8000, dtype=np.uint16)
    grey[0, 0] = 0xFFFF
    buf = io.BytesIO()
    Image.fromarray(grey).save(buf, "PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode == "I;16"
    loaded = decode_image(buf.getvalue(), ImageLimits())
    assert loaded.image.getpixel((1, 1)) == (128, 128, 128)
    assert loaded.image.getpixel((0, 0)) == (255, 255, 255)


def _png(size: tuple[int, int] = (6, 4)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _url(raw: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.mark.parametrize(
    ("url", "limits", "needle"),
    [
        ("data:image/png;base64,A", ImageLimits(), "invalid base64"),
        (_url(b"not a png"), ImageLimits(), "not an image"),
        (_url(_png((64, 64))[:60]), ImageLimits(), "corrupt"),  # a truncated PNG
        (_url(_png((40, 40))), ImageLimits(max_pixels=100), "--max-image-pixels"),
        (
            "data:image/png;base64," + "A" * 400,
            ImageLimits(max_image_bytes=200),
            "--max-image-bytes",
        ),
        (_url(_png()), ImageLimits(max_total_bytes=10), "--max-images-bytes"),
        ("https://example.com/cat.png", ImageLimits(fetch_urls=False), "--no-fetch-urls"),
        (  # app.media_fetch
            "https://example.com/cat.png",
            ImageLimits(allowed_media_domains=("example.org",)),
            "example.com",
        ),
        ("ftp://example.com/cat.png", ImageLimits(), "data:, http: or https:"),
        ("video:" + _url(b"no video"), ImageLimits(video_frames=0), "--video-frames 0"),
        ("video:" + _url(b"no video"), ImageLimits(), "video"),  # app.video_frames (ffmpeg)
        ("twice", ImageLimits(max_images=1), "Too many images: 2"),
    ],
)
@pytest.mark.parametrize(
    ("param", "field"),
    [
        (None, "messages.2.content"),  # chat: the message's own content
        (lambda i: "input", "input"),  # Responses and Anthropic name the list
    ],
)
def test_an_image_refusal_names_the_field_holding_the_image(url, limits, needle, param, field):
    """A refused image (corrupt, too large, unfetchable, a video ffmpeg cannot
    read) answered param null, code null, or param "image 2" (no request field):
    every 400 refusing a request field names it, with code invalid_request."""
    from app.images import ImageSource

    if url == "twice":
        first, url = _url(_png()), _url(_png((4, 4)))
    else:
        first = _url(_png((5, 5)))
    video = url.startswith("video:")
    image = ImageSource(url=url.removeprefix("video:"), video=video)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image", "source": ImageSource(url=first)}]},
        {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "image", "source": image}]},
    ]  # fmt: skip
    if needle == "--max-images-bytes":  # the first image alone fits
        limits = ImageLimits(max_total_bytes=len(_png((5, 5))) + 10)
    kwargs = {"param": param} if param is not None else {}
    with pytest.raises(APIError) as err:
        resolve_images(messages, _Front(), limits, placeholder_notes=False, **kwargs)
    assert err.value.status == 400 and needle in err.value.message
    assert (err.value.param, err.value.code) == (field, "invalid_request")
