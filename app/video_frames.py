"""Video parts as evenly spaced frames, extracted with ffmpeg (worker thread).

A vision model reads a ``video_url`` part as ``--video-frames N`` images taken
at evenly spaced times, each one an ordinary image from then on (limits, cache
identity by pixels, the feature cache): the same video re-sent is the same
frames. ffmpeg runs as a subprocess under a timeout on a temporary file (many
containers need to seek); without ffmpeg a video is a clear 400.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from app.body import decoder_wait
from app.errors import APIError

MAX_FRAME_SIDE = 1280  # frames are scaled down to this; the processor resizes anyway
# What ffmpeg may open for a client's bytes: the temporary file only (no network,
# no other file), read by self-contained container demuxers only. A playlist
# (HLS, concat, ...) would otherwise fetch URLs or read the server's own files.
SAFE_INPUT = [
    "-protocol_whitelist",
    "file",
    "-format_whitelist",
    "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,gif,mpeg,mpegts,flv,ogg,asf",
]


def decoder_cap(max_pixels: int) -> list[str]:
    """ffmpeg's own per-picture limit, held by the decoder for every frame: the
    probe sees only the stream's first size, and a stream may switch to a larger
    one part-way (a new sequence header). Its scratch buffers are padded past the
    picture (a 64x64 MPEG-2 picture asks for 192x280), so it gets slack: frames
    past the cap are never decoded, only skipped."""
    return ["-max_pixels", str(max_pixels + max_pixels // 4 + (1 << 20))]


def ffmpeg_path() -> str | None:
    return shutil.which("ffmpeg")


def extract_frames(
    raw: bytes, frames: int, timeout: float, max_pixels: int | None = None, where: str = "video"
) -> list[bytes]:
    """``frames`` PNG frames of a video, evenly spaced over its duration; within
    ``timeout`` seconds in all, refusing frames over ``max_pixels`` before any
    is decoded (a decoder runs at the size the file declares)."""
    ffmpeg = ffmpeg_path()
    if ffmpeg is None:
        raise APIError(
            400,
            f"{where}: video needs ffmpeg on the server, and it is not installed "
            "(make install installs it; or apt-get install ffmpeg / brew install ffmpeg).",
        )
    with decoder_wait(timeout), tempfile.TemporaryDirectory(prefix="kvwarm-video-") as tmp:
        deadline = time.monotonic() + timeout  # its own time, from its turn to decode
        video = Path(tmp) / "video"
        video.write_bytes(raw)
        probe = _probe(ffmpeg, video, deadline, where)
        if max_pixels is not None and probe.width * probe.height > max_pixels:
            raise APIError(
                400,
                f"{where}: frames of {probe.width}x{probe.height} = "
                f"{probe.width * probe.height} pixels; the limit is {max_pixels} "
                "(--max-image-pixels).",
            )
        # evenly spaced: N frames over the duration (1 fps when it is unknown)
        rate = f"{frames}/{probe.duration:.6f}" if probe.duration else "1"
        scale = f"scale='min({MAX_FRAME_SIDE},iw)':'min({MAX_FRAME_SIDE},ih)'"
        scale += ":force_original_aspect_ratio=decrease"
        cmd = [ffmpeg, "-v", "error", "-nostdin", "-threads", "1", *SAFE_INPUT]
        cmd += [*(decoder_cap(max_pixels) if max_pixels is not None else []), "-i", str(video)]
        # the stream probed and held to the pixel limit, not the one ffmpeg would pick
        cmd += ["-map", "0:v:0", "-vf", f"fps={rate},{scale}", "-frames:v", str(frames)]
        cmd += [str(Path(tmp) / "frame%04d.png")]
        _run(cmd, deadline, where)
        out = [p.read_bytes() for p in sorted(Path(tmp).glob("frame*.png"))]
    if not out:
        raise APIError(400, f"{where}: no frames could be read from the video.")
    return out


@dataclass(frozen=True)
class _Probe:
    width: int
    height: int
    duration: float | None  # seconds; None when the container does not say


def _probe(ffmpeg: str, video: Path, deadline: float, where: str) -> _Probe:
    """The first video stream's size and the container's duration (ffprobe)."""
    ffprobe = shutil.which("ffprobe") or str(Path(ffmpeg).with_name("ffprobe"))
    cmd = [ffprobe, "-v", "error", *SAFE_INPUT, "-select_streams", "v:0"]
    cmd += ["-show_entries", "stream=width,height:format=duration", "-of", "json", str(video)]
    out = _run(cmd, deadline, where)
    try:
        info = json.loads(out)
        stream = info["streams"][0]
        width, height = int(stream["width"]), int(stream["height"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise APIError(400, f"{where}: no video stream ffmpeg can read.") from exc
    try:
        duration: float | None = float(info.get("format", {}).get("duration"))
    except (TypeError, ValueError):
        duration = None
    return _Probe(width, height, duration if duration and duration > 0 else None)


def _run(cmd: list[str], deadline: float, where: str) -> str:
    try:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(cmd, 0)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=left, check=False)
    except subprocess.TimeoutExpired as exc:
        raise APIError(400, f"{where}: reading the video took too long.") from exc
    except OSError as exc:  # ffmpeg without its ffprobe (some static builds)
        raise APIError(
            400, f"{where}: video needs {Path(cmd[0]).name} on the server ({exc.strerror})."
        ) from exc
    if done.returncode != 0:
        detail = (done.stderr or "").strip().splitlines()[-1:] or ["unknown error"]
        raise APIError(400, f"{where}: not a video ffmpeg can read ({detail[0][:200]}).")
    return done.stdout
