"""The persistent tier behind RAM: what the manager needs of it, and where kinds register.

The RAM tier is the manager's own (arrays on the engine thread, counted by the
index's ledger). Below it sits one persistent tier that survives restarts. To
add a kind (another file layout, an object store): write a class with the
methods of ``PersistentTier`` (``kvcache.disk.DiskTier`` is the reference) and
register its factory in ``PERSISTENT_TIERS``; ``--kv-tier`` picks it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from kvcache.blocks import Digest
from kvcache.disk import Arrays, DiskCounters, DiskTier, Scan, WriteEntry


class PersistentTier(Protocol):
    namespace: str
    dir: Path  # where it lives (for logs and /stats)
    counters: DiskCounters
    degraded: str | None  # why it turned itself off; None while usable
    max_occupancy: float
    max_pending_bytes: int  # queued writes past this wait (one alone may exceed it)

    @property
    def usable(self) -> bool: ...

    def room_for(self, nbytes: int) -> bool:
        """Whether a write of ``nbytes`` may be queued now (back-pressure, space)."""
        ...

    def disk_nearly_full(self) -> bool: ...

    def submit(self, job: WriteEntry) -> None:
        """Queue an entry's new blocks and manifest; never blocks the caller."""
        ...

    def completed(self) -> list[tuple[int, int, bool]]:
        """(entry id, which of its writes, written) for writes finished since the last call."""
        ...

    def delete_entry(self, uid: str, blocks: list[Digest]) -> None: ...

    def read_block(self, digest: Digest, nbytes: int | None = None) -> Arrays:
        """A verified block; raises CorruptFile for anything it must not use (damage,
        a file far over ``nbytes``), OSError for a read that failed but may work later."""
        ...

    def read_entry(self, uid: str, nbytes: int | None = None) -> tuple[Arrays, dict[str, Any]]: ...

    def scan(self) -> Scan:
        """Every complete entry at start; what is torn or orphaned is removed."""
        ...

    def read_pins(self) -> dict[str, dict[str, Any]]: ...

    def write_pins(self, pins: dict[str, dict[str, Any]]) -> None: ...

    def pending_bytes(self) -> int: ...

    def flush(self, timeout: float = 30.0) -> bool: ...

    def close(self, timeout: float = 30.0) -> None: ...


# kind -> factory(root, namespace, max pending bytes)
PERSISTENT_TIERS: dict[str, Callable[[Path, str, int], PersistentTier]] = {
    "ssd": DiskTier,
}
