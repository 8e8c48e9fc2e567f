"""Indexing the SSD tier's files at start, so the first turn after a restart is warm.

Saved conversations go first, then the newest entries: what a smaller
``--kv-disk-bytes`` keeps. A save that cannot be served this run (the budget
shrank, or the block size changed) stays on disk untouched; every other entry
the index does not take is deleted with the blocks no indexed entry shares.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcache.blocks import Digest, EntryBytes
from kvcache.entry_files import key_from
from kvcache.index import PrefixIndex
from kvcache.prompt_key import PromptKey
from kvcache.tiers import PersistentTier

log = logging.getLogger("kvwarm.kvcache")

# whether a stored entry's blocks sit where this server would put its tokens' KV
AddressesMatch = Callable[[PromptKey, EntryBytes, str], bool]


@dataclass
class Restored:
    count: int = 0
    pins: dict[str, dict[str, Any]] = field(default_factory=dict)  # saved.json as read
    kept_aside: dict[str, tuple[str, int]] = field(default_factory=dict)  # uid -> (why, bytes)


def restore_entries(
    disk: PersistentTier,
    index: PrefixIndex,
    addresses_match: AddressesMatch,
    kept_blocks: set[Digest],
) -> Restored:
    """Index every complete entry in ``disk``. ``kept_blocks`` (the manager's own
    set, filled in place: evictions while restoring consult it) gets the blocks of
    saves kept aside, which nothing this run deletes."""
    scan = disk.scan()
    done = Restored(pins=disk.read_pins())
    pinned_uids = {pin["uid"] for pin in done.pins.values()}
    order = sorted(scan.entries, key=lambda e: (e.uid not in pinned_uids, -_created(e.manifest)))
    dropped: list[tuple[str, list[Digest]]] = []
    for found in order:
        m = found.manifest
        entry_id, held, why = None, EntryBytes(), ""
        try:
            # its blocks first: a key that cannot be read still names the blocks
            # to delete with it
            held = EntryBytes(
                tuple((bytes.fromhex(d), int(n)) for d, n in m["blocks"]),
                int(m["private_bytes"]),
            )
            key = key_from(m["key"])
            variant = str(m.get("variant", ""))
            why = "written under another --kv-block-size"
            if addresses_match(key, held, variant):
                why = "over a smaller --kv-disk-bytes"
                entry_id = index.restore(
                    key,
                    held,
                    bool(m["trimmable"]),
                    m.get("session"),
                    found.uid,
                    pinned=found.uid in pinned_uids,
                    variant=variant,
                    own_session=m.get("own_session") is True,
                    stored_at=_created(m),
                )
        except Exception:  # noqa: BLE001 - a damaged manifest is discarded, never raised on
            log.warning("KV disk tier: entry %s discarded: its manifest is damaged", found.uid)
            why = ""
        if entry_id is None and why and found.uid in pinned_uids:
            # a save: the budget shrank (an automatic one does as the disk fills)
            # or the block size changed; a restart as before serves it again
            done.kept_aside[found.uid] = (why, held.total)
            kept_blocks.update(d for d, _ in held.blocks)
            continue
        if entry_id is None:
            dropped.append((found.uid, [d for d, _ in held.blocks]))
            continue
        done.count += 1
    # a dropped entry's blocks go with it unless a restored entry holds them
    kept = index.disk.refs
    gone: set[Digest] = set()
    for uid, digests in dropped:
        freed = [d for d in digests if d not in kept and d not in gone and d not in kept_blocks]
        gone.update(freed)
        disk.delete_entry(uid, freed)
        disk.counters.files_discarded += 1
    _log_outcome(disk, index, done, scan.discarded, bool(scan.entries))
    return done


def _log_outcome(
    disk: PersistentTier, index: PrefixIndex, done: Restored, discarded: int, found: bool
) -> None:
    if done.kept_aside:
        reasons: dict[str, int] = {}
        for why, _ in done.kept_aside.values():
            reasons[why] = reasons.get(why, 0) + 1
        log.warning(
            "KV disk tier %s: %d saved conversation entries (%.1f MiB) kept on disk but "
            "not served in this run (%s); a restart with the earlier setting serves them "
            "again, and nothing deletes them meanwhile",
            disk.dir,
            len(done.kept_aside),
            sum(n for _, n in done.kept_aside.values()) / 2**20,
            ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())),
        )
    if found or discarded:
        log.info(
            "KV disk tier %s: %d entries restored (%.0f MiB), %d files discarded",
            disk.dir,
            done.count,
            index.disk.nbytes / 2**20,
            discarded,
        )


def _created(manifest: dict[str, Any]) -> float:
    """When a stored entry was written (0 if its manifest cannot say)."""
    try:
        return float(manifest.get("created", 0))
    except (TypeError, ValueError):
        return 0.0
