"""Saved conversations: the KV a person pins on disk to resume their work later.

A pin names the entry (by its on-disk uid) that holds a conversation's latest
turn; pinned entries outlive eviction and restarts. This module decides which
entry a save pins and keeps the pin list on disk; the KV manager moves the bytes.
A re-save whose entry is still being written waits beside the earlier save,
which stands (on disk and in the list) until the new write lands, and stays if
it fails; a save whose KV leaves the disk (a failed write, damage) is taken back.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from kvcache.index import CacheEntry, PrefixIndex
from kvcache.interface import ConversationNotFound, SavedConversation, StorageFull
from kvcache.sessions import SessionStore
from kvcache.tiers import PersistentTier
from observability.escape import ascii_escaped

log = logging.getLogger("kvwarm.kvcache")

Pins = dict[str, dict[str, Any]]  # conversation id -> {"uid", "title", "saved_at"}
# messages a side request sends at most (a system prompt and one question): a
# save passes over them for the conversation's own turns
SIDE_REQUEST_MESSAGES = 2


class ConversationStore(Protocol):
    """What saving a conversation needs of the KV manager."""

    index: PrefixIndex
    sessions: SessionStore
    disk: PersistentTier | None

    def poll(self) -> None: ...

    def persist(self, entry_id: int) -> bool: ...

    def read_ahead(self, entry: CacheEntry) -> None: ...

    def loading(self, entry: CacheEntry) -> bool: ...


class SavedConversations:
    """The pins over a KV store's entries."""

    def __init__(self, store: ConversationStore):
        self._store = store
        self.pins: Pins = {}
        # re-saves whose entry is not written yet: ``pins`` keeps the earlier save
        # (its entry pinned) until the write lands (``settle``)
        self.pending: Pins = {}
        # saves whose files are on disk but that this run could not index (a smaller
        # budget, another block size): not served, but kept in the list written
        self.unindexed: Pins = {}

    def adopt(self, pins: Pins, known_uids: set[str], kept_uids: set[str]) -> None:
        """Take the pin list read at start-up, less pins of entries that did not
        survive; ``kept_uids``: entries kept on disk but not indexed this run."""
        self.pins = {c: p for c, p in pins.items() if p["uid"] in known_uids}
        self.unindexed = {c: p for c, p in pins.items() if p["uid"] in kept_uids}

    def _write_pins(self) -> None:
        """The list on disk: this run's saves and those it could not index."""
        if self._store.disk is not None:
            self._store.disk.write_pins({**self.unindexed, **self.pins})

    # -- which entry -----------------------------------------------------------
    def _pin(self, conversation_id: str) -> dict[str, Any] | None:
        """The conversation's latest save: a re-save being written, else its pin."""
        return self.pending.get(conversation_id) or self.pins.get(conversation_id)

    def _saved_entry(self, conversation_id: str) -> CacheEntry | None:
        return self._pinned(self._pin(conversation_id))

    def _pinned(self, pin: dict[str, Any] | None) -> CacheEntry | None:
        if pin is not None:
            for e in self._store.index.entries():
                if e.uid == pin["uid"]:
                    return e
        return None

    def _entry_of(self, conversation_id: str) -> CacheEntry:
        """The conversation's cached turn: the saved one, else its latest."""
        saved = self._saved_entry(conversation_id)
        return saved if saved is not None else self._latest_entry(conversation_id, None)

    def _latest_entry(self, conversation_id: str, saved: CacheEntry | None) -> CacheEntry:
        """The turn a save pins, of the conversation's entries (the session
        record's and the ``saved`` one among them; after a restart, on disk): the
        one stored last past a first question, else the longest. Sub-agents send
        their conversation's session id (Claude Code) and may run longer than it,
        but end before it goes on; side requests (a client's title or topic
        request: a system prompt and one question) may be written last."""
        index = self._store.index
        own = [e for e in index.entries() if e.session == conversation_id and not e.forgotten]
        if saved is not None:
            own.append(saved)
        for record in self._store.sessions.branches(conversation_id):
            recorded = index.get(record.entry_id) if record.entry_id is not None else None
            if recorded is not None:
                own.append(recorded)
        if not own:
            raise ConversationNotFound(f"no cached KV for conversation {conversation_id!r}")
        turns = [e for e in own if len(e.key.message_ends) > SIDE_REQUEST_MESSAGES]
        if turns:
            return max(turns, key=lambda e: (e.stored_at, e.length))
        # at its first question (or prompts of no message structure): the longest
        return max(own, key=lambda e: (e.length, e.stored_at))

    def _describe(
        self,
        conversation_id: str,
        entry: CacheEntry | None,
        pin: dict[str, Any] | None = None,
    ) -> SavedConversation:
        """``pin``: the save's record if already off the list; ``entry`` None: its KV is gone."""
        if pin is None:
            pin = self._pin(conversation_id)
        if entry is None:
            tier = "none"
        elif not entry.in_ram and self._store.loading(entry):
            tier = "loading"  # a load's read under way
        else:
            here = (("ram", entry.in_ram), ("disk", entry.on_disk))
            tier = "+".join(t for t, held in here if held) or "writing"
        return SavedConversation(
            conversation_id,
            pin.get("title") if pin else None,
            entry.length if entry is not None else 0,
            entry.held.total if entry is not None else 0,
            tier,
            pin.get("saved_at") if pin else None,
        )

    def _let_go(self, entry: CacheEntry | None) -> None:
        """``entry`` is an ordinary one again unless a save still names it."""
        if entry is None:
            return
        if not any(p["uid"] == entry.uid for p in (*self.pins.values(), *self.pending.values())):
            self._store.index.set_pinned(entry.entry_id, False)

    # -- the four operations ---------------------------------------------------
    def save(self, conversation_id: str, title: str | None) -> SavedConversation:
        """Pin the conversation's KV on disk beyond eviction. ``title`` None keeps
        the earlier save's title, an empty one clears it."""
        store = self._store
        store.poll()
        disk = store.disk
        if disk is None or not disk.usable:
            why = disk.degraded if disk is not None else "--kv-disk-bytes 0 or no usable --kv-dir"
            raise StorageFull(f"the SSD tier is off ({why}): nothing can be saved")
        index = store.index
        confirmed = self._pinned(self.pins.get(conversation_id))
        waiting = self._pinned(self.pending.get(conversation_id))
        entry = self._latest_entry(conversation_id, waiting or confirmed)
        mine = (entry, confirmed, waiting)  # the earlier turns are let go
        others = [e for e in index.entries() if e.pinned and not any(e is m for m in mine)]
        pinned = saved_bytes(others)
        after = saved_bytes([*others, entry])
        limit = index.disk.max_bytes
        if after > limit:
            raise StorageFull(
                f"saving {(after - pinned) / 2**20:.1f} MiB would put saved conversations at "
                f"{after / 2**20:.1f} MiB, over the SSD tier's limit of "
                f"{limit / 2**20:.1f} MiB (--kv-disk-bytes)"
            )
        if not (entry.on_disk or entry.persisting):
            if disk.disk_nearly_full():
                raise StorageFull(
                    f"the file system holding {disk.dir} is over "
                    f"{disk.max_occupancy:.0%} full: nothing more is written"
                )
            if not store.persist(entry.entry_id):
                queued = disk.pending_bytes()  # once: the writer thread moves it
                if queued:
                    raise StorageFull(
                        f"the SSD tier's write queue is full "
                        f"({queued / 2**20:.1f} MiB not yet written): retry shortly"
                    )
                raise StorageFull(
                    f"no room for {entry.held.total / 2**20:.1f} MiB in the SSD tier "
                    f"(limit {limit / 2**20:.1f} MiB, --kv-disk-bytes)"
                )
        index.set_pinned(entry.entry_id, True)
        if title is None:  # absent or null: a re-save keeps the title given before
            earlier_pin = self._pin(conversation_id) or self.unindexed.get(conversation_id)
            title = earlier_pin.get("title") if earlier_pin else None
        pin = {"uid": entry.uid, "title": title or None, "saved_at": time.time()}  # "" clears
        self.pending.pop(conversation_id, None)
        if confirmed is None or entry is confirmed or entry.on_disk:
            self.pins[conversation_id] = pin
        else:  # the earlier save stands until this turn is on disk (``settle``)
            self.pending[conversation_id] = pin
        self.unindexed.pop(conversation_id, None)  # saved anew: the new turn replaces it
        for earlier in (confirmed, waiting):
            if earlier is not entry:
                self._let_go(earlier)
        self._write_pins()
        return self._describe(conversation_id, entry)

    def load(self, conversation_id: str) -> SavedConversation:
        """Begin bringing the conversation's KV into RAM ahead of its next turn:
        its files are read on the reader thread (``tier`` says ``loading`` until
        the engine thread has them in RAM; a turn arriving meanwhile joins the
        read). Out of RAM with its write still queued, there is nothing to read
        yet (``writing``): the write lands shortly."""
        store = self._store
        store.poll()
        entry = self._entry_of(conversation_id)
        if entry.on_disk and not entry.in_ram:
            store.read_ahead(entry)
        return self._describe(conversation_id, entry)

    def listing(self) -> list[SavedConversation]:
        """The saves and the entries they pin (never another turn of theirs)."""
        self._store.poll()
        self.settle()
        out = []
        for conversation_id in sorted({*self.pins, *self.pending}):
            entry = self._saved_entry(conversation_id)
            if entry is not None:
                out.append(self._describe(conversation_id, entry))
        return out

    def settle(self) -> None:
        """Saves after their entries' writes: a re-save whose write landed replaces
        the earlier save, one whose write failed is dropped and the earlier kept;
        a save whose KV is not on disk nor being written is taken back (logged), so
        no listing shows KV that nothing on disk holds."""
        by_uid = {e.uid: e for e in self._store.index.entries()}
        changed = False
        for conversation_id, pin in list(self.pending.items()):
            entry = by_uid.get(pin["uid"])
            if entry is not None and entry.persisting:
                continue
            del self.pending[conversation_id]
            if entry is not None and entry.on_disk:
                earlier = self.pins.get(conversation_id)
                self.pins[conversation_id] = pin
                changed = True
                self._let_go(by_uid.get(earlier["uid"]) if earlier else None)
                continue
            log.error(
                "saved conversation %s: its latest save is not kept, its write failed or "
                "its files were damaged (%s)%s",
                ascii_escaped(conversation_id),
                "still cached in RAM" if entry is not None and entry.in_ram else "lost",
                "; the earlier save stays" if conversation_id in self.pins else "",
            )
            self._let_go(entry)
        for conversation_id, pin in list(self.pins.items()):
            entry = by_uid.get(pin["uid"])
            if entry is not None and (entry.on_disk or entry.persisting):
                continue
            del self.pins[conversation_id]
            changed = True
            log.error(
                "saved conversation %s is no longer saved: its KV is not on the SSD tier "
                "any more, its write failed or its files were damaged (%s)",
                ascii_escaped(conversation_id),
                "still cached in RAM" if entry is not None and entry.in_ram else "lost",
            )
            self._let_go(entry)
        if changed:
            self._write_pins()

    def delete(self, conversation_id: str) -> SavedConversation:
        """Forget a conversation's cached KV, saved or not, in every tier (a turn
        running now keeps its own copy). A save whose KV is gone is deleted too."""
        store = self._store
        index = store.index
        waiting = self._pinned(self.pending.pop(conversation_id, None))
        pin = self.pins.pop(conversation_id, None)
        if pin is None:  # a save this run could not index: deleted from the list
            pin = self.unindexed.pop(conversation_id, None)
        entry = self._pinned(pin)
        if entry is None:
            try:
                entry = self._latest_entry(conversation_id, None)
            except ConversationNotFound:
                if pin is None:
                    raise
        if pin is not None:
            self._write_pins()
        described = self._describe(conversation_id, entry, pin)
        own = {e.entry_id for e in index.entries() if e.session == conversation_id}
        own |= {e.entry_id for e in (entry, waiting) if e is not None}
        for entry_id in own:
            index.forget(entry_id)
        store.sessions.forget(conversation_id)
        return described


def saved_bytes(entries: list[CacheEntry]) -> int:
    """Disk bytes ``entries`` hold together: a block they share counted once (a
    long system prompt under every conversation), each one's own part apiece."""
    blocks = {d: n for e in entries for d, n in e.held.blocks}
    return sum(blocks.values()) + sum(e.held.private for e in entries)
