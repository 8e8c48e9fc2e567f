"""The SSD tier: KV blocks and entries as safetensors files that survive restarts.

Layout under ``--kv-dir``, one folder per namespace (model fingerprint, cache
layout, dtype, file format version), so another model's files are never even
looked at::

    <kv-dir>/<namespace>/blocks/ab/<digest>.safetensors   one shared KV block
    <kv-dir>/<namespace>/entries/<uid>.safetensors        an entry: its private
                                                          arrays + a JSON manifest

A writer thread does every file operation, in submission order (an entry's
blocks before its manifest; a delete after the write it undoes), so decode
steps never wait on the disk. It holds numpy views of arrays the engine thread
made and never writes to; no MLX runs here. Back-pressure: when queued bytes
pass a cap, or the disk is 90% full, new writes are skipped (the entry stays
RAM-only) and counted. Crash safety: temp file, fsync, rename; on start,
temp files are deleted, entries whose blocks are missing are discarded, and
every file is verified again (size, CRC, namespace) when it is read.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from kvcache.blocks import Digest
from kvcache.namespaces import LOCK, try_lock
from kvcache.safetensors_io import (
    CorruptFile,
    encode,
    open_regular,
    read_verified,
    size_limit,
    sync_dir,
    write_atomic,
)

log = logging.getLogger("kvwarm.kvcache.disk")
FORMAT_VERSION = 1
MAX_OCCUPANCY = 0.90  # stop writing when the file system is this full
DEFAULT_PENDING_BYTES = 1 << 30


@dataclass
class Arrays:
    """Named arrays for one file; names in ``bf16`` hold bfloat16 bits as uint16."""

    arrays: dict[str, np.ndarray]
    bf16: frozenset[str] = frozenset()

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


@dataclass
class WriteEntry:
    entry_id: int
    uid: str
    blocks: list[tuple[Digest, Arrays]]  # the blocks not yet on disk
    private: Arrays
    manifest: dict[str, Any]
    write: int = 0  # which of the entry's writes (CacheEntry.writes)

    @property
    def nbytes(self) -> int:
        return self.private.nbytes + sum(a.nbytes for _, a in self.blocks)


@dataclass
class Delete:
    paths: list[Path]


@dataclass
class WriteFile:
    path: Path
    data: bytes


@dataclass
class DiskCounters:
    files_written: int = 0
    bytes_written: int = 0
    write_errors: int = 0
    writes_skipped: int = 0  # back-pressure or a full disk: the entry stayed RAM-only
    files_discarded: int = 0  # torn, corrupt, foreign or orphaned files removed
    loads: int = 0
    load_tokens: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0


@dataclass
class ScannedEntry:
    uid: str
    manifest: dict[str, Any]


@dataclass
class Scan:
    entries: list[ScannedEntry] = field(default_factory=list)
    discarded: int = 0


# a full file system or quota: skipped writes, not a broken disk (the tier stays on)
OUT_OF_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskTier:
    def __init__(
        self,
        root: Path,
        namespace: str,
        max_pending_bytes: int = DEFAULT_PENDING_BYTES,
        max_occupancy: float = MAX_OCCUPANCY,
    ):
        self.namespace = namespace
        self.dir = root / namespace
        self.max_pending_bytes = max_pending_bytes
        self.max_occupancy = max_occupancy
        self.counters = DiskCounters()
        # the saved list whose write failed (a full disk): written again after the
        # next entry the disk takes, or a save acknowledged is lost at restart
        self._pins_unwritten: bytes | None = None
        self.degraded: str | None = None  # why the tier turned itself off
        self._jobs: queue.Queue[WriteEntry | Delete | WriteFile | None] = queue.Queue()
        self._done: queue.Queue[tuple[int, int, bool]] = queue.Queue()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._occupancy_at = 0.0
        self._full = False
        # held before anything is made in it: a server pruning old namespaces must
        # never find this one looking abandoned (kvcache.namespaces)
        self._lock_file = _hold_alone(self.dir)
        (self.dir / "blocks").mkdir(exist_ok=True)
        (self.dir / "entries").mkdir(exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="kvwarm-kv-writer", daemon=True)
        self._thread.start()

    # -- paths ---------------------------------------------------------------
    def block_path(self, digest: Digest) -> Path:
        name = digest.hex()
        return self.dir / "blocks" / name[:2] / f"{name}.safetensors"

    def entry_path(self, uid: str) -> Path:
        return self.dir / "entries" / f"{uid}.safetensors"

    # -- engine-thread side --------------------------------------------------
    @property
    def usable(self) -> bool:
        return self.degraded is None

    def room_for(self, nbytes: int) -> bool:
        """Whether a write of ``nbytes`` may be queued now (back-pressure, disk guard)."""
        if not self.usable:
            return False
        with self._lock:
            # an entry larger than the cap is written once the queue is empty (else never)
            if self._pending_bytes and self._pending_bytes + nbytes > self.max_pending_bytes:
                return False
        return not self.disk_nearly_full()

    def disk_nearly_full(self) -> bool:
        now = time.monotonic()
        if now - self._occupancy_at > 1.0:
            self._occupancy_at = now
            try:
                usage = shutil.disk_usage(self.dir)
                self._full = usage.used >= self.max_occupancy * usage.total
            except OSError:
                self._full = True
        return self._full

    def submit(self, job: WriteEntry) -> None:
        with self._lock:
            self._pending_bytes += job.nbytes
        self._jobs.put(job)

    def delete_entry(self, uid: str, blocks: list[Digest]) -> None:
        paths = [self.entry_path(uid)] + [self.block_path(d) for d in blocks]
        self._jobs.put(Delete(paths))

    def completed(self) -> list[tuple[int, int, bool]]:
        """(entry id, which write, written) for every write finished since the last call."""
        out: list[tuple[int, int, bool]] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued job is done (shutdown, tests)."""
        deadline = time.monotonic() + timeout
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._jobs.unfinished_tasks

    def close(self, timeout: float = 30.0) -> None:
        # a last try of a refused saved list (the disk may have room now), unless
        # writes are still queued: a newer list among them must not be overwritten
        if self.flush(timeout) and self._pins_unwritten is not None:
            self._jobs.put(WriteFile(self.pins_path, self._pins_unwritten))
        self._jobs.put(None)
        self._thread.join(timeout=1.0)
        if not self._thread.is_alive():  # a write still running keeps the folder held
            self._lock_file.close()

    @property
    def pins_path(self) -> Path:
        return self.dir / "saved.json"

    def write_pins(self, pins: dict[str, dict[str, Any]]) -> None:
        """Saved conversations (id -> entry uid, title, time), after the entry's own writes."""
        self._jobs.put(WriteFile(self.pins_path, json.dumps(pins, indent=1).encode()))

    def read_pins(self) -> dict[str, dict[str, Any]]:
        """The saved list; raises OSError when it cannot be read now (the tier then
        stays off for the run: read as no saves, the next save overwrote it)."""
        try:
            pins = json.loads(self.pins_path.read_text())
        except FileNotFoundError:
            return {}
        except (ValueError, RecursionError):  # RecursionError: nested past the limit
            pins = None
        if not isinstance(pins, dict):
            self._move_aside(self.pins_path)
            return {}
        out: dict[str, dict[str, Any]] = {}
        for conversation_id, pin in pins.items():  # a damaged file: keep what is sound
            if not isinstance(pin, dict) or not isinstance(pin.get("uid"), str):
                continue
            title, saved_at = pin.get("title"), pin.get("saved_at")
            out[conversation_id] = {
                "uid": pin["uid"],
                "title": title if isinstance(title, str) else None,
                "saved_at": saved_at if isinstance(saved_at, (int, float)) else None,
            }
        return out

    def _move_aside(self, path: Path) -> None:
        """Keep a damaged saved list where no write lands (the saves in it can be
        recovered by hand); raises OSError if it cannot be moved."""
        for n in range(100):
            aside = path.with_name(f"{path.name}.bad" + (f".{n}" if n else ""))
            if not aside.exists():  # an earlier one stays too
                break
        os.replace(path, aside)
        log.error(
            "the saved conversations list %s cannot be parsed: moved aside to %s; "
            "the saves it named are not known to this server",
            path,
            aside.name,
        )

    # -- reads (engine thread: the arrays become MLX arrays there) -----------
    def read_block(self, digest: Digest, nbytes: int | None = None) -> Arrays:
        """``nbytes``: what the index counts for it (a file far larger is refused unread)."""
        limit = size_limit(nbytes) if nbytes is not None else None
        try:
            arrays, _, bf16 = read_verified(self.block_path(digest), self.namespace, limit)
        except CorruptFile as exc:
            raise CorruptBlock(str(exc), digest) from exc
        return Arrays(arrays, bf16)

    def read_entry(self, uid: str, nbytes: int | None = None) -> tuple[Arrays, dict[str, Any]]:
        limit = size_limit(nbytes) if nbytes is not None else None
        arrays, meta, bf16 = read_verified(self.entry_path(uid), self.namespace, limit)
        try:
            manifest = json.loads(meta["manifest"])
        except (KeyError, ValueError, TypeError, RecursionError) as exc:
            raise CorruptFile(f"{uid}: bad manifest: {exc}") from exc
        return Arrays(arrays, bf16), manifest

    # -- start-up ------------------------------------------------------------
    def scan(self) -> Scan:
        """Every complete entry whose blocks are all present; the rest is deleted."""
        out = Scan()
        for tmp in self._files(".*.tmp-*"):
            out.discarded += self._unlink(tmp)
        referenced: set[str] = set()
        unreadable = 0  # entries kept unread: which blocks they name is not known
        for path in sorted((self.dir / "entries").glob("*.safetensors")):
            try:
                manifest = self._manifest(path)
            except OSError as exc:  # EIO, EACCES, EMFILE: may read next start
                unreadable += 1
                log.warning("KV entry %s could not be read at start, kept: %s", path.name, exc)
                continue
            names = _block_names(manifest.get("blocks")) if manifest else None
            if manifest is None or names is None:
                out.discarded += self._unlink(path)
                continue
            if not all(self.block_path(bytes.fromhex(n)).exists() for n in names):
                out.discarded += self._unlink(path)
                continue
            referenced.update(names)
            out.entries.append(ScannedEntry(path.stem, manifest))
        if unreadable:  # the sweep could take blocks only those entries name
            log.warning(
                "%d KV entries could not be read at start: kept, and no unreferenced "
                "block deleted this time",
                unreadable,
            )
        else:
            for block in self._block_files("*.safetensors"):
                if block.stem not in referenced:
                    out.discarded += self._unlink(block)
        self.counters.files_discarded += out.discarded
        return out

    def _files(self, pattern: str) -> Iterator[Path]:
        yield from self.dir.glob(pattern)  # saved.json's
        yield from (self.dir / "entries").glob(pattern)
        yield from self._block_files(pattern)

    def _block_files(self, pattern: str) -> Iterator[Path]:
        """Files in the block shards, never through a symlinked shard (the sweep
        deleted files in whatever folder it pointed to)."""
        for shard in (self.dir / "blocks").iterdir():
            if shard.is_dir() and not shard.is_symlink():
                yield from shard.glob(pattern)

    def _manifest(self, path: Path) -> dict[str, Any] | None:
        """The manifest from a file's header alone (the data is verified on load);
        None for damage or a foreign file, OSError for a read that may work later."""
        try:
            f, _ = open_regular(path)  # a FIFO blocked the start here
            with f:
                head = f.read(8)
                hlen = int.from_bytes(head, "little") if len(head) == 8 else -1
                if not 0 < hlen < 64 * 2**20:
                    return None
                header = json.loads(f.read(hlen))
            meta = header["__metadata__"]
            if meta.get("namespace") != self.namespace:
                return None
            manifest = json.loads(meta["manifest"])
        except (
            CorruptFile,  # a FIFO, a symlink, or gone since it was listed
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            RecursionError,
        ):
            return None  # RecursionError: JSON nested past Python's limit
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
            return None
        return manifest

    @staticmethod
    def _unlink(path: Path) -> int:
        try:
            path.unlink()
            return 1
        except OSError:
            return 0

    # -- the writer thread ---------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if isinstance(job, Delete):
                    for path in job.paths:
                        self._unlink(path)
                elif isinstance(job, WriteFile):
                    self._write_file(job)
                else:
                    self._write(job)
            except Exception:  # noqa: BLE001 - the thread outlives any one job
                self.counters.write_errors += 1
                log.exception("KV disk writer: a job failed")
            finally:
                self._jobs.task_done()

    def _write(self, job: WriteEntry) -> None:
        ok = False
        try:
            if self.degraded is None:
                meta = {"namespace": self.namespace}
                renamed_into: set[Path] = set()  # shard folders that got new names
                for digest, arrays in job.blocks:
                    path = self.block_path(digest)
                    if path.exists():
                        continue  # written for an entry that since left; same bytes
                    try:
                        path.parent.mkdir()
                        renamed_into.add(path.parent.parent)  # blocks/ got a new shard
                    except FileExistsError:
                        pass
                    self._count(write_atomic(path, encode(arrays.arrays, meta, arrays.bf16)))
                    renamed_into.add(path.parent)
                # their names durable before an entry names them: after a power loss
                # the entry could survive a block it needs (once per folder, not block)
                for folder in sorted(renamed_into, key=lambda f: -len(f.parts)):
                    sync_dir(folder)  # shards before blocks/
                # blocks it shares were left to the entry queued before it: if that
                # write failed they are not here, and this manifest would name nothing
                missing = sum(
                    not self.block_path(bytes.fromhex(name)).exists()
                    for name, _ in job.manifest["blocks"]
                )
                if missing:
                    log.warning(
                        "KV disk writer: entry %s not written: %d of its shared blocks "
                        "are missing (an earlier write failed); it stays in RAM",
                        job.uid,
                        missing,
                    )
                    return
                manifest = json.dumps(job.manifest, separators=(",", ":"))
                parts = encode(job.private.arrays, {**meta, "manifest": manifest}, job.private.bf16)
                self._count(write_atomic(self.entry_path(job.uid), parts))
                sync_dir(self.entry_path(job.uid).parent)  # acknowledged: it must survive
                ok = True
                if self._pins_unwritten is not None:
                    self._write_file(WriteFile(self.pins_path, self._pins_unwritten))
        except OSError as exc:
            if exc.errno in OUT_OF_SPACE:  # passes: later writes wait for room, as when 90% full
                self.counters.writes_skipped += 1
                self._full, self._occupancy_at = True, time.monotonic()
                log.warning(
                    "KV disk writer: %s full (%s); entry %s stays in RAM", self.dir, exc, job.uid
                )
                return
            self.counters.write_errors += 1
            self.degraded = f"{type(exc).__name__}: {exc}"
            log.warning(
                "the KV disk tier at %s is off (%s); cached KV stays in RAM only",
                self.dir,
                self.degraded,
            )
        except Exception:  # noqa: BLE001 - this entry's data, not the disk: it stays RAM-only
            self.counters.write_errors += 1
            log.exception("KV disk writer: entry %s not written", job.uid)
        finally:
            with self._lock:
                self._pending_bytes -= job.nbytes
            self._done.put((job.entry_id, job.write, ok))

    def _write_file(self, job: WriteFile) -> None:
        pins = job.path == self.pins_path
        try:
            write_atomic(job.path, [job.data])
            sync_dir(job.path.parent)
        except OSError as exc:
            self.counters.write_errors += 1
            log.warning("could not write %s: %s", job.path, exc)
            if pins:
                self._pins_unwritten = job.data
            return
        if pins:
            self._pins_unwritten = None

    def _count(self, size: int) -> None:
        self.counters.files_written += 1
        self.counters.bytes_written += size


def _block_names(blocks: Any) -> list[str] | None:
    """A manifest's block digests (hex), or None unless it is a list of
    [hex digest, byte count] pairs: a damaged manifest is discarded, never raised on."""
    if not isinstance(blocks, list):
        return None
    names = []
    for block in blocks:
        if not (isinstance(block, list) and len(block) == 2):
            return None
        name, nbytes = block
        if not (isinstance(name, str) and name and isinstance(nbytes, int)):
            return None
        try:
            bytes.fromhex(name)
        except ValueError:
            return None
        names.append(name)
    return names


class CorruptBlock(CorruptFile):
    """A shared block's file is damaged: every entry naming it is."""

    def __init__(self, message: str, digest: Digest):
        super().__init__(message)
        self.digest = digest


class TierInUse(OSError):
    """Another process serves from this folder."""


def _hold_alone(folder: Path) -> IO[bytes]:
    """An exclusive lock on ``folder`` for as long as the returned file stays open.
    Two servers on one folder deleted each other's temp files and unreferenced
    blocks at start (the other's writes in flight), evicted each other's blocks
    and each counted only its own bytes against --kv-disk-bytes."""
    path = folder / LOCK
    for _ in range(5):
        folder.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+b")  # noqa: SIM115 - held open: the lock lives as long as the file
        held = try_lock(f)
        if _same_file(f, path):
            if held:
                os.utime(path)  # when this namespace was last served (kvcache.namespaces)
                return f
            f.close()
            raise TierInUse(
                f"another kvwarm server uses {folder}; give each server its own --kv-dir"
            )
        f.close()  # the folder was moved away meanwhile (pruned as old): make it again
        time.sleep(0.05)
    raise TierInUse(f"{folder} kept being removed while this server started")


def _same_file(f: IO[bytes], path: Path) -> bool:
    try:
        here, there = os.fstat(f.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
