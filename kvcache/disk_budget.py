"""How many bytes the SSD tier may use when the user does not say."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

AUTO_SHARE = 4  # a quarter of the free disk
AUTO_CAP = 64 * 2**30


def resolve_disk_bytes(root: Path, configured: int | None) -> int:
    """``configured`` bytes, or (None) a quarter of the disk free at ``root`` with
    what ``root`` already holds counted as free (else each restart after the tier
    filled found less free space, shrank the budget and deleted stored KV), at
    most 64 GiB; 0 when the folder cannot be made (the tier stays off)."""
    if configured is not None:
        return configured
    try:
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
    except OSError:
        return 0
    return min((free + held_bytes(root)) // AUTO_SHARE, AUTO_CAP)


def held_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (symlinks not followed)."""
    total = 0
    stack = [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue  # deleted meanwhile
        except OSError:
            continue
    return total
