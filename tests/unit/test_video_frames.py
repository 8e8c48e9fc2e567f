"""Video parts become evenly spaced frames (ffmpeg), each an ordinary image."""

from __future__ import annotations

import base64
import io
import shutil
import subprocess

import pytest
from PIL import Image

from app.errors import APIError
from app.images import ImageLimits, ImageSource, load_images, source_of
from app.video_frames import extract_frames
from tests.helpers.tiny_vlm import make_video
from tests.helpers.tools import require


def data_url(raw: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(raw).decode()


def test_a_video_becomes_the_frames_asked_for_spread_over_its_length(tmp_path):
    clip = make_video(tmp_path, seconds=2.0, fps=4)  # 8 frames
    frames = extract_frames(clip, 4, timeout=30)
    assert len(frames) == 4 and len(set(frames)) == 4  # four distinct moments
    (loaded,) = load_images([ImageSource(url=data_url(clip), video=True)], ImageLimits())
    assert len(loaded) == 8  # --video-frames default
    assert len({f.digest for f in loaded}) == 8
    assert all(f.image.size == (64, 48) for f in loaded)
    again = load_images([ImageSource(url=data_url(clip), video=True)], ImageLimits())[0]
    assert [f.digest for f in again] == [f.digest for f in loaded]  # the cache can match


def test_the_pixel_limit_holds_for_the_stream_decoded(tmp_path):
    """ffprobe measures the first video stream; ffmpeg picked the default (or
    largest) one itself: a small first stream let a large second one through."""
    ffmpeg = require("ffmpeg", shutil.which("ffmpeg"))
    clip = tmp_path / "two.mkv"
    small, large = "testsrc=size=64x48:rate=2:duration=1", "testsrc=size=320x240:rate=2:duration=1"
    cmd = [ffmpeg, "-v", "error", "-y", "-f", "lavfi", "-i", small, "-f", "lavfi", "-i", large]
    cmd += ["-map", "0", "-map", "1", "-c:v", "mpeg4"]
    cmd += ["-disposition:v:0", "0", "-disposition:v:1", "default", str(clip)]
    subprocess.run(cmd, check=True)
    frames = extract_frames(clip.read_bytes(), 2, 30.0, max_pixels=64 * 48, where="video 1")
    assert frames and {Image.open(io.BytesIO(f)).size for f in frames} == {(64, 48)}


def test_a_stream_that_grows_past_the_pixel_limit_midway_is_not_decoded_large(tmp_path):
    """The probe reads the first picture's size: a stream switching to a larger one
    later (a new sequence header) had its large frames decoded at full size."""
    ffmpeg = require("ffmpeg", shutil.which("ffmpeg"))
    parts = []
    for colour, size in (("red", "160x160"), ("blue", "1280x1280")):
        part = tmp_path / f"{colour}.ts"
        source = f"color={colour}:s={size}:d=1:r=8"
        cmd = [ffmpeg, "-v", "error", "-y", "-f", "lavfi", "-i", source, "-c:v", "mpeg2video"]
        subprocess.run([*cmd, str(part)], check=True)
        parts.append(part.read_bytes())
    frames = extract_frames(b"".join(parts), 8, 30.0, max_pixels=200 * 200, where="video 1")
    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in frames]
    assert images and {im.size for im in images} == {(160, 160)}
    assert all(im.getpixel((0, 0))[0] > 200 for im in images)  # red: the small part only


def test_ffmpeg_without_ffprobe_is_a_400_that_says_so(monkeypatch, tmp_path):
    ffmpeg = tmp_path / "ffmpeg"
    ffmpeg.write_text("#!/bin/sh\nexit 0\n")
    ffmpeg.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name: str(ffmpeg) if name == "ffmpeg" else None)
    with pytest.raises(APIError) as err:
        extract_frames(b"anything", 4, timeout=5)
    assert err.value.status == 400 and "ffprobe" in str(err.value)


def test_video_url_parts_name_their_source_as_a_video():
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    assert source_of(part, "messages.0.content.0") == ImageSource(
        url="data:video/mp4;base64,AAAA", video=True
    )


@pytest.mark.parametrize(
    ("limits", "raw", "needle"),
    [
        (ImageLimits(), b"not a video at all" * 10, "not a video ffmpeg can read"),
        (ImageLimits(video_frames=0), b"x", "--video-frames 0"),
        (ImageLimits(max_video_bytes=100), b"x" * 200, "--max-video-bytes"),
    ],
)
def test_bad_or_refused_videos_are_a_400_naming_why(limits, raw, needle):
    require("ffmpeg", shutil.which("ffmpeg"))
    with pytest.raises(APIError) as err:
        load_images([ImageSource(url=data_url(raw), video=True)], limits)
    assert err.value.status == 400 and needle in str(err.value)


def test_without_ffmpeg_a_video_is_a_400_that_says_so(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(APIError) as err:
        extract_frames(b"anything", 4, timeout=5)
    assert err.value.status == 400 and "ffmpeg" in str(err.value)


def test_a_playlist_cannot_make_ffmpeg_read_the_servers_files_or_urls(tmp_path):
    """An HLS playlist naming a local video (and a URL) is refused, not followed."""
    clip = tmp_path / "private.mp4"
    clip.write_bytes(make_video(tmp_path))
    playlist = (
        "#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nhttp://127.0.0.1:9/x.ts\n"
        f"#EXTINF:10,\nfile://{clip}\n#EXT-X-ENDLIST\n"
    ).encode()
    with pytest.raises(APIError) as err:
        extract_frames(playlist, 2, timeout=30)
    assert err.value.status == 400


def test_a_videos_frame_size_is_checked_before_any_frame_is_decoded(tmp_path):
    clip = make_video(tmp_path, seconds=1.0, size=(320, 240))
    with pytest.raises(APIError) as err:
        extract_frames(clip, 2, timeout=30, max_pixels=320 * 240 - 1)
    assert err.value.status == 400 and "320x240" in str(err.value)
    assert "--max-image-pixels" in str(err.value)
    assert len(extract_frames(clip, 2, timeout=30, max_pixels=320 * 240)) == 2


def test_a_videos_bytes_count_in_the_requests_total(tmp_path):
    clip = make_video(tmp_path)
    limits = ImageLimits(max_total_bytes=len(clip) - 1)
    with pytest.raises(APIError) as err:
        load_images([ImageSource(url=data_url(clip), video=True)], limits)
    assert err.value.status == 400 and "--max-images-bytes" in str(err.value)
