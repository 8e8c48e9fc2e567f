"""What a save of a conversation's KV promises: its title, its byte budget, a
re-save whose write fails, a save whose KV is found damaged, which turn it pins
and a load that reads off the engine thread. Model-free (the helpers of
test_kv_disk_faults)."""

from __future__ import annotations

import json
import threading

import kvcache.disk as disk_module
from kvcache.disk import CorruptBlock
from kvcache.disk_reads import PendingHit
from kvcache.manager import TieredKVManager
from kvcache.prompt_key import PromptKey
from kvcache.safetensors_io import CorruptFile
from scheduler.request import CacheHints
from tests.engine.test_kv_disk_faults import NS, caches_for, manager, served, store


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


def _writes_fail(monkeypatch) -> None:
    real = disk_module.encode

    def failing(arrays, meta, bf16=frozenset()):
        if "manifest" in meta:  # an entry's own file: the write fails
            raise ValueError("simulated bad write")
        return real(arrays, meta, bf16)

    monkeypatch.setattr(disk_module, "encode", failing)


def test_a_resave_whose_write_fails_keeps_the_earlier_save(tmp_path, monkeypatch):
    """A re-save let the earlier turn go and pinned the new one before its write
    landed; the write failed and the conversation was no longer saved at all."""
    m = manager(tmp_path)
    try:
        first = list(range(1000, 1100))
        store(m, first, "S")
        m.flush()
        m.save_conversation("S", "my work")
        _writes_fail(monkeypatch)
        store(m, first + list(range(3000, 3050)), "S")
        m.flush()  # write-through failed: in RAM only, the save writes it again
        assert m.save_conversation("S", None).tokens == 150
        m.flush()  # and fails again
        monkeypatch.undo()
        (saved,) = m.saved_conversations()
        assert (saved.tokens, saved.title, saved.tier) == (100, "my work", "ram+disk")
        assert [e.length for e in m.index.entries() if e.pinned] == [100]
    finally:
        m.close()
    again = manager(tmp_path)
    try:
        assert [(c.conversation_id, c.tokens) for c in again.saved_conversations()] == [("S", 100)]
    finally:
        again.close()


def test_a_resave_lets_the_earlier_turn_go_once_its_write_lands(tmp_path, monkeypatch):
    m = manager(tmp_path)
    gate = threading.Event()
    try:
        first = list(range(1000, 1100))
        old = store(m, first, "S")
        m.flush()
        m.save_conversation("S", "my work")
        m.flush()
        real = disk_module.encode

        def held(arrays, meta, bf16=frozenset()):
            assert gate.wait(5)
            return real(arrays, meta, bf16)

        monkeypatch.setattr(disk_module, "encode", held)
        new = store(m, first + list(range(3000, 3050)), "S")
        assert m.save_conversation("S", None).tokens == 150
        # until the new turn is on disk the earlier save stands (on disk and pinned)
        assert m.index.get(old).pinned and m.index.get(new).pinned
        on_disk = json.loads((tmp_path / NS / "saved.json").read_text())
        assert [p["uid"] for p in on_disk.values()] == [m.index.get(old).uid]
        gate.set()
        m.flush()
        assert not m.index.get(old).pinned and m.index.get(new).pinned
        assert [(c.tokens, c.title) for c in m.saved_conversations()] == [(150, "my work")]
    finally:
        gate.set()
        m.close()
    again = manager(tmp_path)
    try:
        assert [(c.tokens, c.title) for c in again.saved_conversations()] == [(150, "my work")]
    finally:
        again.close()


def test_a_save_whose_kv_is_found_damaged_is_taken_back(tmp_path):
    """The pin outlived its damaged entry: the listing showed a later, unsaved turn
    under the saved title, and the restart had nothing."""
    m = manager(tmp_path)
    try:
        first = list(range(1000, 1100))
        store(m, first, "A")
        m.save_conversation("A", "important")
        store(m, first + list(range(3000, 3040)), "A")  # a later turn, not saved
        m.flush()
        (pinned,) = [e for e in m.index.entries() if e.pinned]
        m.damaged(pinned, CorruptFile("a damaged file, found by a read"))
        assert m.saved_conversations() == []
        m.flush()
        assert json.loads((tmp_path / NS / "saved.json").read_text()) == {}
    finally:
        m.close()


def test_a_damaged_block_takes_back_every_save_naming_it(tmp_path):
    """A save whose disk copy a damaged shared block took (its RAM copy kept) was
    still listed, as RAM only, and gone after a restart."""
    m = manager(tmp_path)
    try:
        _two_conversations_on_one_prefix(m)
        m.save_conversation("A", "a")
        m.save_conversation("B", "b")
        m.flush()
        a = next(e for e in m.index.entries() if e.session == "A")
        digest, _ = a.held.blocks[0]
        m.damaged(a, CorruptBlock("a damaged block", digest))
        b = next(e for e in m.index.entries() if e.session == "B")
        assert b.in_ram and not b.on_disk and not b.pinned
        assert m.saved_conversations() == []
    finally:
        m.close()


def test_a_load_reads_the_saved_kv_off_the_engine_thread(tmp_path, monkeypatch):
    """POST /v1/conv_kv/load read the files on the thread that called it (the
    engine's, as a control job): a multi-GB save paused every running stream for
    the whole read. The reader thread reads them now, the load answers at once,
    and a turn arriving meanwhile joins that read."""
    tokens = list(range(1000, 1400))
    m = manager(tmp_path)
    store(m, tokens, "conv")
    m.save_conversation("conv", None)
    m.close()
    m = manager(tmp_path)  # restarted: the save is on disk only
    gate, readers = threading.Event(), []
    real = m.disk.read_entry

    def held(uid, nbytes=None):
        readers.append(threading.current_thread().name)
        gate.wait(5)
        return real(uid, nbytes)

    monkeypatch.setattr(m.disk, "read_entry", held)
    try:
        assert m.load_conversation("conv").tier == "loading"
        assert [c.tier for c in m.saved_conversations()] == ["loading"]
        hints = CacheHints(PromptKey.build(tokens + [1, 2]), "probe")
        pending, _ = m.lookup("r", hints, max_growth=0, defer_disk=True)
        assert isinstance(pending, PendingHit)
        gate.set()
        assert pending.ticket.wait(5)
        reuse, report = m.finish_read(pending)
        assert reuse is not None and report.tier == "disk"
        m.release(reuse.entry_id)
        assert readers == ["kvwarm-kv-reader"]  # read once, off the calling thread
        m.flush()
        assert [c.tier for c in m.saved_conversations()] == ["ram+disk"]
        assert all(e.refs == 0 for e in m.index.entries())
    finally:
        gate.set()
        m.close()


def test_a_load_nobody_joins_lands_in_ram(tmp_path):
    tokens = list(range(1000, 1400))
    m = manager(tmp_path)
    store(m, tokens, "conv")
    m.save_conversation("conv", None)
    m.close()
    m = manager(tmp_path)
    try:
        m.load_conversation("conv")
        assert m.load_conversation("conv").tier == "loading"  # one read, not two
        m.flush()  # the read done, the engine thread's poll makes it arrays in RAM
        assert m.load_conversation("conv").tier == "ram+disk"
        assert m.disk.counters.loads == 1
        assert served(m, tokens + [1]) == (tokens, "ram")
        assert all(e.refs == 0 for e in m.index.entries())
    finally:
        m.close()


def _turn(m: TieredKVManager, tokens: list[int], messages: int, session: str = "cc") -> int:
    """A chat turn's KV: ``tokens`` cut into ``messages`` messages."""
    ends = [len(tokens) * (i + 1) // messages for i in range(messages)]
    entry_id = m.store(PromptKey.build(tokens, (), ends), caches_for(tokens), session=session)
    assert entry_id is not None
    return entry_id


def test_a_save_pins_the_latest_turn_not_a_longer_sub_agents(tmp_path):
    """Claude Code's sub-agents send the session id of the conversation that ran
    them: a save pinned the session's longest entry, a sub-agent's transcript,
    and the person's conversation was not the one kept."""
    main = list(range(1000, 1300))
    m = manager(tmp_path)
    try:
        _turn(m, list(range(7000, 7500)), 6)  # a sub-agent's transcript, longer
        _turn(m, main, 5)  # the conversation, after the sub-agent answered
        _turn(m, list(range(9000, 9060)), 2)  # a title request: one question, written last
        assert m.save_conversation("cc", "refactor").tokens == 300
    finally:
        m.close()
    again = manager(tmp_path)  # after a restart the files say which turn came last
    try:
        assert [c.tokens for c in again.saved_conversations()] == [300]
        again.delete_conversation("cc")
    finally:
        again.close()
    for turns in ([(7000, 500, 6), (1000, 300, 5)], [(1000, 300, 5), (7000, 500, 6)]):
        m = manager(tmp_path / f"restart-{turns[0][0]}")
        for start, n, messages in turns:
            _turn(m, list(range(start, start + n)), messages)
        m.close()
        again = manager(tmp_path / f"restart-{turns[0][0]}")
        try:  # saved after the restart: the turn stored last
            assert again.save_conversation("cc", None).tokens == turns[-1][1]
        finally:
            again.close()
