"""What a save of a conversation's KV promises: its title, its byte budget, a
re-save whose write fails, a save whose KV is found damaged, which turn it pins
and a load that reads off the engine thread. Model-free (the helpers of
test_kv_disk_faults)."""

from __future__ import annotations

from tests.engine.test_kv_disk_faults import manager, store


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
