"""Other namespaces in one --kv-dir: KV of models, versions or cache layouts this
server does not read. Each server only ever looked in its own folder, so every
model switch, weights update or format change left up to a whole budget behind
that nothing evicted. At start, the dir as a whole is brought within the budget:
other namespaces go least recently used first, except one a running server holds
or one with saved conversations (the user asked to keep those). This server's
namespace then grows to its budget at most, so the dir stays within twice it,
and a model used in turn with another keeps its KV while there is room."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path
from typing import IO

from kvcache.disk_budget import held_bytes

log = logging.getLogger("kvwarm.kvcache")
LOCK = ".lock"  # a running server holds it (kvcache.disk); its mtime: last start
PINS = "saved.json"
TOMBSTONE = ".deleting-"  # a folder being deleted, moved aside first


def prune_other_namespaces(root: Path, keep: str, budget: int) -> list[str]:
    """Delete other namespace folders under ``root``, least recently started first,
    until the dir holds at most ``budget`` bytes; returns the deleted names."""
    try:
        found = list(root.iterdir())
    except OSError:
        return []
    for p in found:  # a deletion cut short (a kill): nobody's anymore
        if p.name.startswith(TOMBSTONE) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
    others = [p for p in found if p.name != keep and _namespace(p)]
    sizes = {p: held_bytes(p) for p in others}
    total = held_bytes(root / keep) + sum(sizes.values())
    deleted = []
    for folder in sorted(others, key=_last_started):
        if total <= budget:
            break
        if _has_pins(folder) or not _delete_unless_held(folder):
            continue
        total -= sizes[folder]
        deleted.append(folder.name)
        log.info(
            "KV dir %s: deleted namespace %s (%.1f MiB of another model, version or layout, "
            "least recently used) to keep the dir within --kv-disk-bytes",
            root,
            folder.name,
            sizes[folder] / 2**20,
        )
    return deleted


def _namespace(path: Path) -> bool:
    """A namespace folder (its blocks/ and entries/), not a symlink or a stray file."""
    return (
        not path.name.startswith(".")
        and path.is_dir()
        and not path.is_symlink()
        and (path / "blocks").is_dir()
        and (path / "entries").is_dir()
    )


def _last_started(folder: Path) -> float:
    for marker in (folder / LOCK, folder):
        try:
            return marker.stat().st_mtime
        except OSError:
            continue
    return 0.0


def _has_pins(folder: Path) -> bool:
    """Whether the folder holds saved conversations: a pins file that exists but
    cannot be read (its permissions, a disk error, a hand edit) counts as pinned,
    never as leave to delete what a user saved; so does one moved aside as damaged
    (kvcache.disk)."""
    if any(folder.glob(f"{PINS}.bad*")):
        return True
    try:
        pins = json.loads((folder / PINS).read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError, RecursionError):  # RecursionError: nested past the limit
        return True
    return bool(pins)


def _delete_unless_held(folder: Path) -> bool:
    """Delete ``folder`` under its lock; False when a running server holds it. It
    is moved aside first, under the lock: a server starting on that name meanwhile
    makes a fresh folder (kvcache.disk checks its lock is the folder's)."""
    try:
        with open(folder / LOCK, "a+b") as f:
            if not try_lock(f):
                return False
            aside = folder.with_name(f"{TOMBSTONE}{folder.name}-{os.getpid()}")
            folder.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
    except OSError:
        return False
    return True


def try_lock(f: IO[bytes]) -> bool:
    """An exclusive lock on the open ``f``, held until it closes; False: another
    process (a running server) holds it."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
