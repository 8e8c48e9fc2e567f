"""Giving freed KV memory back to the operating system.

``mx.clear_cache`` hands MLX's freed buffers to the C allocator. On Linux,
glibc keeps freed heap pages in its arenas unless they sit at the top of the
heap, and KV blocks (tens of KiB each, freed in no particular order) seldom
do: without a trim the process's resident memory creeps up under churn
although the cache's bytes stay at their cap. ``malloc_trim(0)`` releases
every whole free page. macOS's allocator returns large blocks by itself.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable

import mlx.core as mx


def _glibc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # absent on musl: nothing to trim there
    except (OSError, AttributeError):
        return None


class MemoryReturner:
    """Clears MLX's buffer cache and, at most every ``min_interval_s``, trims the
    C heap (a trim walks the arenas: a few milliseconds, not for every step)."""

    def __init__(self, min_interval_s: float = 2.0):
        self.min_interval_s = min_interval_s
        self._trim = _glibc_trim()
        self._last = float("-inf")
        self.trims = 0

    def __call__(self) -> None:
        mx.clear_cache()
        now = time.monotonic()
        if self._trim is not None and now - self._last >= self.min_interval_s:
            self._last = now
            self._trim(0)
            self.trims += 1
