"""How many bytes the SSD tier may use when the user does not say."""

from __future__ import annotations

import shutil
from pathlib import Path

AUTO_SHARE = 4  # a quarter of the free disk
AUTO_CAP = 64 * 2**30


def resolve_disk_bytes(root: Path, configured: int | None) -> int:
    """``configured`` bytes, or (None) a quarter of the disk free at ``root``,
    at most 64 GiB; 0 when the folder cannot be made (the tier stays off)."""
    if configured is not None:
        return configured
    try:
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
    except OSError:
        return 0
    return min(free // AUTO_SHARE, AUTO_CAP)
