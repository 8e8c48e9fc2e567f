"""Reading an adapter directory: file work only, no MLX, so it runs off both the
event loop and the engine thread (a slow or hung file system stalls nobody's
decode). The engine then builds the weights from the very bytes read here."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler.contracts import AdapterError, AdapterFiles, AdapterFormatError, AdapterTooLarge

if TYPE_CHECKING:
    from scheduler.admission import MemoryBudget

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # mlx_lm.lora writes a few hundred bytes

# The weights' safetensors header is checked here, off the engine thread: mx.load
# there builds every tensor before a name is looked at, and its cost grows with
# the count (100k one-element tensors in 8 MiB held the engine thread 5 s).
LEAVES = ("lora_a", "lora_b", "m")  # per adapted layer: the pair and DoRA's magnitude
_NDIM = {"lora_a": 2, "lora_b": 2, "m": 1}
_DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4}  # the floats a mount keeps
_NAME = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*\.(lora_a|lora_b|m)")
MAX_NAME = 512  # a module path of a real model is under 100 characters
# the bound where the model's linear layers are not known: 3 leaves on each of
# ~1365 layers (a 128-block model adapting all 7 of its projections needs 2688)
MAX_TENSORS = 4096
_HEADER_BYTES_PER_TENSOR = 1024  # a name up to MAX_NAME, dtype, shape and offsets
_MAX_METADATA_BYTES = 64 << 10
# while an adapter mounts, the bytes read from its file (AdapterFiles.weights, held
# until the mount returns) and the arrays MLX builds from them are both in memory
MOUNT_PEAK_FACTOR = 2


def mount_peak_bytes(weights_size: int) -> int:
    """What mounting weights of ``weights_size`` bytes holds at its peak."""
    return MOUNT_PEAK_FACTOR * weights_size


def never_fits_bytes(budget: MemoryBudget) -> int:
    """The largest weights file that could ever be mounted under ``budget``: the KV
    room with no adapter mounted (those mounted now can be unmounted), at the mount's
    peak. Between that and the room left now, the engine answers (unmount another,
    or retry later)."""
    return replace(budget, adapter_bytes=0).kv_budget_bytes // MOUNT_PEAK_FACTOR


def tensor_cap(adapter_layers: int) -> int:
    """The most tensors an adapter of a model with ``adapter_layers`` linear layers
    can hold (a lora_a, lora_b and m each); 0 layers: not known, MAX_TENSORS."""
    return len(LEAVES) * adapter_layers if adapter_layers > 0 else MAX_TENSORS


def _unreadable(file: Path, why: str) -> AdapterFormatError:
    return AdapterFormatError(f"{file} is not a readable safetensors file: {why}")


def _check_safetensors(raw: bytes, max_tensors: int, file: Path) -> None:
    """The header of ``raw`` (an 8-byte little-endian length, then a JSON object of
    name -> dtype, shape, data_offsets) against what a mount can take: at most
    ``max_tensors`` tensors, each an adapter leaf of a float dtype whose bytes are
    exactly its shape's, inside the file. AdapterError names the first problem."""
    if len(raw) < 8:
        raise _unreadable(file, f"{len(raw)} bytes, shorter than its header's length")
    size = int.from_bytes(raw[:8], "little")
    data_bytes = len(raw) - 8 - size
    if data_bytes < 0:
        raise _unreadable(file, f"a header of {size} bytes in a file of {len(raw)}")
    if size > _MAX_METADATA_BYTES + _HEADER_BYTES_PER_TENSOR * max_tensors:
        raise AdapterFormatError(
            f"{WEIGHTS_FILE}'s header is {size} bytes, more than the {max_tensors} tensors "
            "an adapter of this model can have would take"
        )
    try:
        header = json.loads(raw[8 : 8 + size])
    except (ValueError, RecursionError) as exc:
        raise _unreadable(file, f"its header is no JSON ({str(exc)[:100]})") from None
    if not isinstance(header, dict):
        raise _unreadable(file, "its header is no JSON object")
    header.pop("__metadata__", None)  # free-form strings ("format": "mlx")
    if not header:
        raise AdapterFormatError(f"{file} holds no tensors")
    if len(header) > max_tensors:
        raise AdapterFormatError(
            f"{WEIGHTS_FILE} holds {len(header)} tensors, more than the {max_tensors} an "
            "adapter of this model can have (lora_a, lora_b and m per linear layer)"
        )
    for name, entry in header.items():
        _check_tensor(name, entry, data_bytes, file)


def _check_tensor(name: str, entry: Any, data_bytes: int, file: Path) -> None:
    shown = repr(name[:MAX_NAME])
    match = _NAME.fullmatch(name) if len(name) <= MAX_NAME else None
    if match is None:
        raise AdapterFormatError(
            f"tensor {shown} is not an adapter parameter (expected <layer>.lora_a, .lora_b or .m)"
        )
    if not isinstance(entry, dict):
        raise _unreadable(file, f"tensor {shown} has no dtype, shape and offsets")
    dtype = entry.get("dtype")
    if dtype not in _DTYPE_BYTES:
        raise AdapterFormatError(
            f"tensor {shown} is {str(dtype)[:20]}, not a float (F16, BF16 or F32: "
            "float16, bfloat16 or float32)"
        )
    shape = entry.get("shape")
    ndim = _NDIM[match.group(1)]
    if (
        not isinstance(shape, list)
        or len(shape) != ndim
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise AdapterFormatError(
            f"tensor {shown} has shape {str(shape)[:60]}, not {ndim} non-negative sizes"
        )
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise _unreadable(
            file, f"tensor {shown}'s data_offsets {str(offsets)[:60]} are not within its data"
        )
    want = math.prod(shape) * _DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != want:
        raise _unreadable(
            file,
            f"tensor {shown} of shape {shape} needs {want} bytes, its data_offsets hold "
            f"{offsets[1] - offsets[0]}",
        )


def _check_config(config: Any, where: Path) -> dict[str, Any]:
    if not isinstance(config, dict):
        raise AdapterFormatError(f"{where} must hold a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterFormatError(
            f"fine_tune_type {kind!r} cannot be mounted: only lora and dora adapters "
            "(a full fine-tune is a model of its own)"
        )
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterFormatError(f"{CONFIG_FILE} has no lora_parameters object")
    rank, scale = params.get("rank"), params.get("scale")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterFormatError(f"lora_parameters.rank must be a positive integer, got {rank!r}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not _finite(scale):
        # NaN or 1e400 (json reads both) mounted, and every token it ran was NaN
        raise AdapterFormatError(
            f"lora_parameters.scale must be a finite number, got {str(scale)[:40]}"
        )
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
    return AdapterFormatError(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")


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
            raise AdapterFormatError(
                f"{CONFIG_FILE} is not readable JSON: {str(exc)[:200]}"
            ) from None
        weights = path / WEIGHTS_FILE
        if not weights.is_file():  # a first look only (serve's start): the read checks again
            raise AdapterError(f"{shown} has no {WEIGHTS_FILE}")
    except OSError as exc:  # a name too long, no permission, ...
        raise AdapterError(f"cannot read the adapter at {shown!r}: {exc.strerror}") from None
    return path, shown, raw_config, config, weights


def read_adapter_files(
    path: Path, max_weights_bytes: int | None = None, max_tensors: int = MAX_TENSORS
) -> AdapterFiles:
    """Check and fingerprint an ``mlx_lm.lora`` adapter directory (AdapterError: a 400);
    weights over ``max_weights_bytes`` (what KV the budget has at all) are refused
    before they are read into memory, and a safetensors header past ``max_tensors``
    (tensor_cap) or naming anything but adapter leaves before the engine sees it."""
    path, shown, raw_config, config, weights = _adapter_config(path)

    def too_large(size: int) -> AdapterError:
        assert max_weights_bytes is not None
        return AdapterTooLarge(
            f"{WEIGHTS_FILE} is {size / 2**20:.1f} MiB; a mount holds {MOUNT_PEAK_FACTOR}x "
            f"that at its peak, more than the whole KV budget "
            f"({max_weights_bytes * MOUNT_PEAK_FACTOR / 2**20:.1f} MiB): it could never be mounted"
        )

    try:
        raw_weights = _read_regular(weights, max_weights_bytes, too_large)
    except FileNotFoundError:  # gone since the first look
        raise AdapterError(f"{shown} has no {WEIGHTS_FILE}") from None
    except OSError as exc:  # a name too long, no permission, ...
        raise AdapterError(f"cannot read the adapter at {shown!r}: {exc.strerror}") from None
    _check_safetensors(raw_weights, max_tensors, weights)
    digest = hashlib.sha256(raw_config)
    digest.update(raw_weights)
    return AdapterFiles(
        path=path,
        config=config,
        weights_file=weights,
        fingerprint=digest.hexdigest()[:16],
        weights=raw_weights,
    )
