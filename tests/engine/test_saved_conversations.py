"""What a save of a conversation's KV promises: its title, its byte budget, a
re-save whose write fails, a save whose KV is found damaged, which turn it pins
and a load that reads off the engine thread. Model-free (the helpers of
test_kv_disk_faults)."""

from __future__ import annotations

from kvcache.manager import TieredKVManager
from tests.engine.test_kv_disk_faults import manager, store


def _two_conversations_on_one_prefix(m: TieredKVManager) -> tuple[list[int], list[int]]:
    shared = list(range(1000, 1640))  # a long system prompt both agents send
    a, b = shared + list(range(5000, 5032)), shared + list(range(6000, 6032))
    store(m, a, "A")
    store(m, b, "B")
    m.flush()
    return a, b


def test_saving_again_without_a_title_keeps_the_earlier_one(tmp_path):
    """A re-save (a client saving after each turn) with no title erased the one
    the person gave; an empty string still clears it."""
    m = manager(tmp_path)
    try:
        first = list(range(500, 600))
        store(m, first, "S")
        assert m.save_conversation("S", "my refactor").title == "my refactor"
        store(m, first + list(range(600, 700)), "S")
        assert m.save_conversation("S", None).title == "my refactor"
        assert [c.title for c in m.saved_conversations()] == ["my refactor"]
        assert m.save_conversation("S", "renamed").title == "renamed"
        assert m.save_conversation("S", "").title is None
    finally:
        m.close()
    again = manager(tmp_path)
    try:
        assert [c.title for c in again.saved_conversations()] == [None]
    finally:
        again.close()


def test_saves_sharing_blocks_count_them_once_against_the_disk_limit(tmp_path):
    """The budget summed each saved entry's whole size: two conversations on one
    long system prompt counted it twice, and a save that fit on disk got a 507."""
    m = manager(tmp_path / "big")
    _two_conversations_on_one_prefix(m)
    both = m.index.disk.nbytes  # the shared blocks once, each entry's own part
    m.close()
    small = manager(tmp_path / "small", disk_bytes=both + 1024)
    try:
        _two_conversations_on_one_prefix(small)
        assert all(e.on_disk for e in small.index.entries())
        small.save_conversation("A", "a")
        assert small.save_conversation("B", "b").tier == "ram+disk"
        assert [c.conversation_id for c in small.saved_conversations()] == ["A", "B"]
    finally:
        small.close()
