"""Reading an adapter directory: file work only, no MLX, so it runs off both the
event loop and the engine thread (a slow or hung file system stalls nobody's
decode). The engine then builds the weights from the very bytes read here."""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scheduler.contracts import AdapterError, AdapterFiles, AdapterTooLarge

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # mlx_lm.lora writes a few hundred bytes


def _check_config(config: Any, where: Path) -> dict[str, Any]:
    if not isinstance(config, dict):
        raise AdapterError(f"{where} must hold a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(
            f"fine_tune_type {kind!r} cannot be mounted: only lora and dora adapters "
            "(a full fine-tune is a model of its own)"
        )
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError(f"{CONFIG_FILE} has no lora_parameters object")
    rank, scale = params.get("rank"), params.get("scale")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"lora_parameters.rank must be a positive integer, got {rank!r}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not _finite(scale):
        # NaN or 1e400 (json reads both) mounted, and every token it ran was NaN
        raise AdapterError(f"lora_parameters.scale must be a finite number, got {str(scale)[:40]}")
    return config


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer of 400 digits
        return False


def check_adapter_dir(path: Path | str) -> None:
    """All read_adapter_files checks short of the weights' size and bytes (AdapterError):
    serve's start refuses an --adapter before the model loads, not after (exit 1)."""
    _adapter_config(path)


def _read_regular(path: Path, limit: int | None, too_large: Callable[[int], AdapterError]) -> bytes:
    """The bytes of ``path`` through one open file: a check by name and a read by
    name again raced a swap (a FIFO there blocked the worker for good) and a file
    growing meanwhile (read whole past the limit). Non-blocking, so a FIFO's open
    waits for no writer; checked regular and sized on the descriptor; never more
    than ``limit`` + 1 bytes read. ``too_large(size)``: the error past ``limit``."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb") as file:  # closes fd
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AdapterError(f"{path.name} is not a regular file")
        if limit is not None and info.st_size > limit:  # refused before a byte is read
            raise too_large(info.st_size)
        data = file.read() if limit is None else file.read(limit + 1)
    if limit is not None and len(data) > limit:  # grew after the fstat (or stat lies: /proc)
        raise too_large(len(data))
    return data


def _config_too_large(size: int) -> AdapterError:
    return AdapterError(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")


def _adapter_config(path: Path | str) -> tuple[Path, str, bytes, dict[str, Any], Path]:
    """The expanded path, its shown form, the config's bytes and contents, the
    weights file (present, not read)."""
    try:
        path = Path(path).expanduser()
    except RuntimeError:  # "~name" for a user this machine does not have
        raise AdapterError(f"adapter path {str(path)[:256]!r}: no such home directory") from None
    shown = str(path)[:256]
    if "\x00" in str(path):
        raise AdapterError(f"adapter path {shown!r} holds a NUL character")
    try:
        if not path.is_dir():
            raise AdapterError(f"adapter path {shown!r} is not a directory")
        config_file = path / CONFIG_FILE
        try:
            raw_config = _read_regular(config_file, MAX_CONFIG_BYTES, _config_too_large)
        except FileNotFoundError:
            raise AdapterError(
                f"{shown} has no {CONFIG_FILE} (is it an mlx_lm.lora adapter?)"
            ) from None
        try:
            config = _check_config(json.loads(raw_config), config_file)
        except (ValueError, RecursionError) as exc:
            if isinstance(exc, AdapterError):
                raise
            raise AdapterError(f"{CONFIG_FILE} is not readable JSON: {str(exc)[:200]}") from None
        weights = path / WEIGHTS_FILE
        if not weights.is_file():  # a first look only (serve's start): the read checks again
            raise AdapterError(f"{shown} has no {WEIGHTS_FILE}")
    except OSError as exc:  # a name too long, no permission, ...
        raise AdapterError(f"cannot read the adapter at {shown!r}: {exc.strerror}") from None
    return path, shown, raw_config, config, weights


def read_adapter_files(path: Path, max_weights_bytes: int | None = None) -> AdapterFiles:
    """Check and fingerprint an ``mlx_lm.lora`` adapter directory (AdapterError: a 400);
    weights over ``max_weights_bytes`` (what KV the budget has at all) are refused
    before they are read into memory."""
    path, shown, raw_config, config, weights = _adapter_config(path)

    def too_large(size: int) -> AdapterError:
        assert max_weights_bytes is not None
        return AdapterTooLarge(
            f"{WEIGHTS_FILE} is {size / 2**20:.1f} MiB, more than the whole KV budget "
            f"({max_weights_bytes / 2**20:.1f} MiB): it could never be mounted"
        )

    try:
        raw_weights = _read_regular(weights, max_weights_bytes, too_large)
    except FileNotFoundError:  # gone since the first look
        raise AdapterError(f"{shown} has no {WEIGHTS_FILE}") from None
    except OSError as exc:  # a name too long, no permission, ...
        raise AdapterError(f"cannot read the adapter at {shown!r}: {exc.strerror}") from None
    digest = hashlib.sha256(raw_config)
    digest.update(raw_weights)
    return AdapterFiles(
        path=path,
        config=config,
        weights_file=weights,
        fingerprint=digest.hexdigest()[:16],
        weights=raw_weights,
    )
