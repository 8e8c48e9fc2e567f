"""Disk-tier hits read off the engine thread.

A hit on an entry that lives only on the SSD tier needs its files read and
CRC-checked before MLX can use them: seconds for a multi-GB entry, which on
the engine thread paused decoding for every running row. The reading (numpy
only, no MLX) runs here, on one reader thread the KV manager owns; the engine
thread turns the bytes into MLX arrays once they are ready
(``TieredKVManager.finish_read``). While a read is in flight its entry stays
held (index refs), so nothing evicts or deletes its files. A hit reusing a
prefix of a trimmable entry reads only the blocks that prefix needs (``ReadPlan``):
a new conversation on a long one's system prompt read all of it. Rows that hit one
entry while a read of it deep enough for them is in flight share that read
(``SharedRead``); one whose rows all went away is cancelled (skipped if not begun,
its result dropped if it was).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcache.blocks import Digest
from kvcache.disk import Arrays

if TYPE_CHECKING:
    from kvcache.entries import CacheEntry, Lookup
    from kvcache.payloads import BlockArrays, PrivatePart
    from kvcache.tiers import PersistentTier
    from scheduler.request import CacheHints, CacheReport

log = logging.getLogger("kvwarm.kvcache.reads")


@dataclass
class ReadPlan:
    """What one disk hit reads: the entry's first ``blocks`` blocks (``have``: those
    in RAM already, shared with an entry there; ``need``: the files to read), and
    its own file (private part, manifest) when ``whole``: only then is the entry
    promoted into RAM, a partial read's KV serves its rows alone."""

    have: dict[Digest, BlockArrays]
    need: list[tuple[Digest, int]]
    blocks: int
    whole: bool

    def covers(self, other: ReadPlan) -> bool:
        """Whether this read holds all ``other`` would read."""
        return self.whole or (not other.whole and other.blocks <= self.blocks)


@dataclass(frozen=True)
class ReadFiles:
    """What the reader thread hands back: an entry's verified files, numpy only."""

    blocks: dict[Digest, Arrays]  # the blocks that were not in RAM when the read began
    private: Arrays | None  # None: a partial read (its own file left unread)
    manifest: dict[str, Any] | None
    nbytes: int
    seconds: float


def read_files(
    disk: PersistentTier,
    uid: str,
    private_nbytes: int,
    need: list[tuple[Digest, int]],
    whole: bool = True,
) -> ReadFiles:
    """Read and verify ``need``'s block files and, if ``whole``, the entry's own
    file (no MLX). Raises CorruptFile for damage; anything else (OSError,
    MemoryError) may pass."""
    started = time.monotonic()
    blocks = {digest: disk.read_block(digest, size) for digest, size in need}
    private, manifest = disk.read_entry(uid, private_nbytes) if whole else (None, None)
    nbytes = sum(a.nbytes for a in blocks.values()) + (private.nbytes if private is not None else 0)
    return ReadFiles(blocks, private, manifest, nbytes, time.monotonic() - started)


class ReadTicket:
    """One read handed to the reader thread; its result is taken on the engine thread."""

    def __init__(self, job: Callable[[], ReadFiles], on_done: Callable[[], None]):
        self._job = job
        self._on_done = on_done
        self._done = threading.Event()
        self._result: ReadFiles | None = None
        self._error: BaseException | None = None
        self.cancelled = False

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Its row went away: skipped if not begun, its result dropped if it was."""
        self.cancelled = True
        self._result = None

    def run(self) -> None:
        try:
            if not self.cancelled:
                self._result = self._job()
        except BaseException as exc:  # noqa: BLE001 - handed to the engine thread
            self._error = exc
        finally:
            if self.cancelled:
                self._result = self._error = None  # nobody reads it: let the bytes go
            self._job = _nothing
            self._done.set()
            self._on_done()

    def outcome(self) -> ReadFiles:
        """The files, or the read's error raised (only once ``done``)."""
        assert self._done.is_set()
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError("the read was cancelled")
        return self._result


def _nothing() -> ReadFiles:
    raise RuntimeError("the read already ran")


class DiskReader:
    """One daemon thread running reads in submission order; never joined on
    close (a read stuck on a dead disk must not hold the shutdown)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[ReadTicket | None] = queue.Queue()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvwarm-kv-reader", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], ReadFiles]) -> ReadTicket:
        ticket = ReadTicket(job, self._finished.set)
        self._jobs.put(ticket)
        return ticket

    def wait_any(self, timeout: float) -> None:
        """Until some read finishes (or ``timeout``): the engine's idle wait."""
        self._finished.wait(timeout)
        self._finished.clear()

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            ticket = self._jobs.get()
            if ticket is None:
                return
            ticket.run()


@dataclass
class SharedRead:
    """One read of an entry's files, shared by every row that hit the entry while
    it was in flight (sub-agents after a restart): each read its own copy before,
    twice the I/O and a second transient copy of the KV. Engine-thread state."""

    ticket: ReadTicket
    plan: ReadPlan  # what it reads, and the blocks in RAM when it began
    rows: int = 1  # rows waiting on it: the last one gone drops it
    # the first row to take it up leaves what it made for the others: the KV as
    # MLX arrays (made once), or that it failed (sorted out once: kept or discarded)
    loaded: tuple[list[BlockArrays], PrivatePart] | None = None
    failed: bool = False


@dataclass
class PendingHit:
    """A disk-tier hit whose files are being read; its entry is held (this row's
    own ref) until ``finish_read`` or ``cancel_read``."""

    request_id: str
    hints: CacheHints
    entry: CacheEntry
    result: Lookup
    read: SharedRead
    miss: CacheReport  # what the request reports if the read fails
    known_session: bool
    released: bool = False  # its entry's ref was given back

    @property
    def ticket(self) -> ReadTicket:
        return self.read.ticket

    @property
    def done(self) -> bool:
        return self.read.ticket.done
