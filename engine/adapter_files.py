"""Reading an adapter directory: file work only, no MLX, so it runs off both the
event loop and the engine thread (a slow or hung file system stalls nobody's
decode). The engine then loads the weights it names, from the page cache."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from scheduler.contracts import AdapterError, AdapterFiles

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"


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
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        # NaN or 1e400 (json reads both) mounted, and every token it ran was NaN
        raise AdapterError(f"lora_parameters.scale must be a finite number, got {scale!r}")
    return config


def read_adapter_files(path: Path) -> AdapterFiles:
    """Check and fingerprint an ``mlx_lm.lora`` adapter directory (AdapterError: a 400)."""
    try:
        path = Path(path).expanduser()
    except RuntimeError:  # "~name" for a user this machine does not have
        raise AdapterError(f"adapter path {str(path)[:256]!r}: no such home directory") from None
    shown = str(path)[:256]
    try:
        if not path.is_dir():
            raise AdapterError(f"adapter path {shown!r} is not a directory")
        try:
            raw_config = (path / CONFIG_FILE).read_bytes()
        except FileNotFoundError:
            raise AdapterError(
                f"{shown} has no {CONFIG_FILE} (is it an mlx_lm.lora adapter?)"
            ) from None
        try:
            config = _check_config(json.loads(raw_config), path / CONFIG_FILE)
        except ValueError as exc:
            if isinstance(exc, AdapterError):
                raise
            raise AdapterError(f"{CONFIG_FILE} is not readable JSON: {exc}") from None
        weights = path / WEIGHTS_FILE
        if not weights.is_file():
            raise AdapterError(f"{shown} has no {WEIGHTS_FILE}")
        before = weights.stat()
        digest = hashlib.sha256(raw_config)
        with open(weights, "rb") as f:  # also brings the file into the page cache
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError as exc:  # a name too long, no permission, ...
        raise AdapterError(f"cannot read the adapter at {shown!r}: {exc.strerror}") from None
    return AdapterFiles(
        path=path,
        config=config,
        weights_file=weights,
        fingerprint=digest.hexdigest()[:16],
        weights_size=before.st_size,
        weights_mtime_ns=before.st_mtime_ns,
    )
