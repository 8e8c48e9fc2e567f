"""Video parts as evenly spaced frames, extracted with ffmpeg (worker thread).

A vision model reads a ``video_url`` part as ``--video-frames N`` images taken
at evenly spaced times, each one an ordinary image from then on (limits, cache
identity by pixels, the feature cache): the same video re-sent is the same
frames. ffmpeg runs as a subprocess under a timeout on a temporary file (many
containers need to seek); without ffmpeg a video is a clear 400.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

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


def ffmpeg_path() -> str | None:
    return shutil.which("ffmpeg")


def extract_frames(raw: bytes, frames: int, timeout: float, where: str = "video") -> list[bytes]:
    """``frames`` PNG frames of a video, evenly spaced over its duration."""
    ffmpeg = ffmpeg_path()
    if ffmpeg is None:
        raise APIError(
            400,
            f"{where}: video needs ffmpeg on the server, and it is not installed "
            "(make install installs it; or apt-get install ffmpeg / brew install ffmpeg).",
        )
    with tempfile.TemporaryDirectory(prefix="kvwarm-video-") as tmp:
        video = Path(tmp) / "video"
        video.write_bytes(raw)
        duration = _duration(ffmpeg, video, timeout)
        # evenly spaced: N frames over the duration (1 fps when it is unknown)
        rate = f"{frames}/{duration:.6f}" if duration else "1"
        scale = f"scale='min({MAX_FRAME_SIDE},iw)':'min({MAX_FRAME_SIDE},ih)'"
        scale += ":force_original_aspect_ratio=decrease"
        cmd = [ffmpeg, "-v", "error", "-nostdin", *SAFE_INPUT, "-i", str(video)]
        cmd += ["-vf", f"fps={rate},{scale}", "-frames:v", str(frames)]
        cmd += [str(Path(tmp) / "frame%04d.png")]
        _run(cmd, timeout, where)
        out = [p.read_bytes() for p in sorted(Path(tmp).glob("frame*.png"))]
    if not out:
        raise APIError(400, f"{where}: no frames could be read from the video.")
    return out


def _duration(ffmpeg: str, video: Path, timeout: float) -> float | None:
    """The container's duration in seconds (ffprobe beside ffmpeg), or None."""
    ffprobe = shutil.which("ffprobe") or str(Path(ffmpeg).with_name("ffprobe"))
    cmd = [ffprobe, "-v", "error", *SAFE_INPUT, "-show_entries", "format=duration"]
    cmd += ["-of", "csv=p=0"]
    try:
        out = subprocess.run(
            [*cmd, str(video)], capture_output=True, text=True, timeout=timeout, check=False
        )
        value = float(out.stdout.strip())
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return value if value > 0 else None


def _run(cmd: list[str], timeout: float, where: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise APIError(400, f"{where}: reading frames took over {timeout:g} s.") from exc
    if done.returncode != 0:
        detail = (done.stderr or "").strip().splitlines()[-1:] or ["unknown error"]
        raise APIError(400, f"{where}: not a video ffmpeg can read ({detail[0][:200]}).")
