"""The SSD tier against its own failures: files damaged on disk, a restart under
other settings, a write or a load that raises. Model-free: each position's KV
holds the token it was computed for, so a test can see which text a served
cache belongs to (the model must never read KV of text it did not see)."""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from kvcache import safetensors_io
from kvcache.disk_reads import PendingHit
from kvcache.index import PromptCacheConfig, VolatilePolicy
from kvcache.interface import ConversationNotFound, StorageFull
from kvcache.manager import DiskConfig, TieredKVManager
from kvcache.prompt_key import PromptKey
from scheduler.request import CacheHints

NS = "faults-v1"
LAYERS = 2
GiB = 2**30


def caches_for(tokens: list[int]) -> list[KVCache]:
    """KV whose position p holds float(tokens[p]) (+ the layer number)."""
    out = []
    for layer in range(LAYERS):
        cache = KVCache()
        t = mx.array(tokens, dtype=mx.float32).reshape(1, 1, len(tokens), 1)
        k = mx.broadcast_to(t, (1, 2, len(tokens), 8)) + layer
        cache.update_and_fetch(k, k * 2)
        out.append(cache)
    return out


def manager(root: Path, kv_block: int = 16, disk_bytes: int = GiB) -> TieredKVManager:
    config = PromptCacheConfig(block_size=16, kv_block_size=kv_block, policy=VolatilePolicy.STRICT)
    template = [KVCache() for _ in range(LAYERS)]
    return TieredKVManager(config, GiB, NS, template, DiskConfig(root, disk_bytes))


def store(m: TieredKVManager, tokens: list[int], session: str = "s") -> int:
    entry_id = m.store(PromptKey.build(tokens), caches_for(tokens), session=session)
    assert entry_id is not None
    return entry_id


def served(
    m: TieredKVManager, prompt: list[int], defer: bool = False
) -> tuple[list[int], str] | None:
    """The tokens the reused KV was computed for, and the tier it came from
    (``defer``: a disk hit read on the reader thread, as the engine reads it)."""
    hints = CacheHints(PromptKey.build(prompt), "probe")
    reuse, report = m.lookup("r", hints, max_growth=0, defer_disk=defer)
    if isinstance(reuse, PendingHit):
        assert reuse.ticket.wait(5)
        reuse, report = m.finish_read(reuse)
    if reuse is None:
        return None
    m.release(reuse.entry_id)
    keys = reuse.caches[0].keys[0, 0, : reuse.kv_depth, 0]
    return [int(x) for x in keys.tolist()], report.tier


def entry_files(root: Path) -> list[Path]:
    return sorted((root / NS / "entries").glob("*.safetensors"))


def block_files(root: Path) -> list[Path]:
    return sorted((root / NS / "blocks").glob("*/*.safetensors"))


def one_entry_on_disk(root: Path, tokens: list[int]) -> Path:
    """Store ``tokens``' KV through a manager that then closes: the entry's file."""
    m = manager(root)
    store(m, tokens)
    m.close()
    (entry,) = entry_files(root)
    return entry


def rewrite(path: Path, old: bytes, new: bytes) -> None:
    raw = path.read_bytes()
    assert len(old) == len(new) and raw.count(old) == 1, old
    path.write_bytes(raw.replace(old, new))


def test_an_entry_of_whole_blocks_is_written_and_the_writer_goes_on(tmp_path):
    # 64 tokens in 16-token blocks: no private tail, an array with a zero in its shape
    whole, other = list(range(1000, 1064)), list(range(5000, 5050))
    m = manager(tmp_path)
    store(m, whole, "a")
    store(m, other, "b")
    m.close()
    assert m.disk.counters.write_errors == 0
    assert all(e.on_disk and not e.persisting for e in m.index.entries())
    again = manager(tmp_path)
    assert again.restored == 2
    assert served(again, whole + [1, 2]) == (whole, "disk")
    assert served(again, other + [1, 2]) == (other, "disk")
    again.close()


def test_a_write_that_raises_fails_that_entry_alone(tmp_path, monkeypatch):
    real = safetensors_io.encode
    calls = {"n": 0}

    def flaky(arrays, metadata, bf16=frozenset()):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("a bug in one entry's arrays")
        return real(arrays, metadata, bf16)

    monkeypatch.setattr("kvcache.disk.encode", flaky)
    first, second = list(range(100, 150)), list(range(200, 250))
    m = manager(tmp_path)
    a, b = store(m, first, "a"), store(m, second, "b")
    m.flush()
    m.poll()
    assert m.disk.counters.write_errors == 1 and m.disk.usable
    assert m.disk.pending_bytes() == 0
    on_disk = {e.entry_id: e.on_disk for e in m.index.entries()}
    assert on_disk == {a: False, b: True}
    assert not any(e.persisting for e in m.index.entries())
    assert served(m, first + [1]) == (first, "ram")  # still served from RAM
    m.close()


def test_a_restart_under_another_kv_block_size_restores_nothing(tmp_path):
    tokens = list(range(1000, 1200))
    m = manager(tmp_path, kv_block=16)
    store(m, tokens)
    m.close()
    other = manager(tmp_path, kv_block=64)
    assert other.restored == 0
    assert served(other, tokens[:150] + [7, 8, 9]) is None
    other.flush()
    assert entry_files(tmp_path) == [] and block_files(tmp_path) == []
    other.close()


@pytest.mark.parametrize("position", [5, 99])  # in a shared block; in the private tail
def test_a_flipped_token_in_a_stored_manifest_is_never_served(tmp_path, position):
    tokens = list(range(1000, 1100))  # 6 blocks of 16 + a 4-token tail
    entry = one_entry_on_disk(tmp_path, tokens)
    was = tokens[position]
    after = b"]" if position == len(tokens) - 1 else b","
    rewrite(entry, b"," + str(was).encode() + after, b"," + str(was - 1).encode() + after)
    again = manager(tmp_path)
    # a block's token moves its address (refused at start); a tail token is caught
    # by the checksum when the entry is read (discarded at its first hit)
    assert again.restored == (0 if position < 96 else 1)
    prompt = list(tokens)
    prompt[position] = was - 1  # the text the altered manifest claims
    assert served(again, prompt + [1, 2]) is None
    assert again.index.entries() == []
    # what the client saw is what /metrics says: a miss, no reuse, no disk hit
    st = again.stats()
    assert st.hits == st.tokens_reused == st.disk_hits == st.disk_tokens_reused == 0
    assert st.misses == 1
    again.close()


def test_a_damaged_manifest_is_discarded_at_start_not_raised(tmp_path):
    tokens = list(range(1000, 1100))
    entry = one_entry_on_disk(tmp_path, tokens)
    raw = entry.read_bytes()
    start = raw.index(b'blocks\\":[[\\"') + len(b'blocks\\":[[\\"')
    entry.write_bytes(raw[:start] + b"q" + raw[start + 1 :])  # not hex any more
    again = manager(tmp_path)  # raised ValueError before
    assert again.restored == 0 and again.disk.counters.files_discarded >= 1
    assert served(again, tokens + [1]) is None
    again.close()


def test_a_manifest_with_an_unreadable_date_does_not_stop_the_start(tmp_path):
    tokens = list(range(1000, 1100))
    entry = one_entry_on_disk(tmp_path, tokens)
    raw = entry.read_bytes()
    at = raw.index(b'created\\":') + len(b'created\\":')
    end = raw.index(b"}", at)
    stamp = raw[at:end]
    bad = b'\\"' + b"x" * (len(stamp) - 4) + b'\\"'  # a string where a number was
    entry.write_bytes(raw[:at] + bad + raw[end:])
    again = manager(tmp_path)  # float("xx") in the restore order raised before
    assert again.restored == 1
    again.close()


def test_an_entry_that_cannot_be_assembled_is_dropped_not_leaked(tmp_path, monkeypatch):
    tokens = list(range(1000, 1050))
    m = manager(tmp_path)
    store(m, tokens)
    m.close()
    again = manager(tmp_path)

    def broken(template, arrays, meta, nbytes):  # a manifest naming arrays the file lacks
        raise KeyError("tail.0.k")

    monkeypatch.setattr("kvcache.manager.rebuild_private", broken)
    assert served(again, tokens + [1]) is None  # raised KeyError before, holding a ref
    assert again.index.entries() == []
    st = again.stats()
    assert (st.hits, st.misses, st.tokens_reused, st.disk_hits) == (0, 1, 0, 0)
    monkeypatch.undo()
    store(again, tokens)
    assert served(again, tokens + [1]) == (tokens, "ram")
    again.close()


def test_a_smaller_disk_budget_at_restart_deletes_what_it_drops(tmp_path):
    m = manager(tmp_path)
    for i in range(4):
        store(m, [10_000 * (i + 1) + t for t in range(250)], f"s{i}")
    m.close()
    one = max(e.held.total for e in m.index.entries())
    again = manager(tmp_path, disk_bytes=one + 100)
    again.flush()
    assert again.restored == 1
    (kept,) = again.index.entries()
    assert len(entry_files(tmp_path)) == 1
    assert len(block_files(tmp_path)) == len(kept.held.blocks)
    on_disk = sum(p.stat().st_size for p in (tmp_path / NS).rglob("*.safetensors"))
    assert on_disk < 2 * one  # the dropped entries' blocks went with them
    again.close()


def test_every_header_byte_is_checksummed(tmp_path):
    path = tmp_path / "f.safetensors"
    arrays = {"k": np.arange(6, dtype=np.float32).reshape(2, 3), "e": np.zeros((1, 0, 2))}
    safetensors_io.write_atomic(path, safetensors_io.encode(arrays, {"namespace": "n", "m": "ab"}))
    got, meta, _ = safetensors_io.read_verified(path, "n")
    assert got["e"].shape == (1, 0, 2) and meta["m"] == "ab"
    rewrite(path, b'"m":"ab"', b'"m":"ac"')
    with pytest.raises(safetensors_io.CorruptFile, match="checksum"):
        safetensors_io.read_verified(path, "n")


def test_a_file_of_the_previous_format_still_reads(tmp_path):
    """Written when the checksum covered the data alone: kept, not discarded as damaged."""
    data = np.arange(6, dtype=np.float32).tobytes()
    meta = {"namespace": "n", "nbytes": str(len(data)), "crc32": str(zlib.crc32(data))}
    header = {"k": {"dtype": "F32", "shape": [6], "data_offsets": [0, len(data)]}}
    text = json.dumps({**header, "__metadata__": meta}).encode()
    path = tmp_path / "old.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    got, _, _ = safetensors_io.read_verified(path, "n")
    assert got["k"].tolist() == [0, 1, 2, 3, 4, 5]


def test_an_entry_writing_past_the_queues_share_stays_in_ram_until_written(tmp_path, monkeypatch):
    """A lone write larger than the queue's share is queued; the queue holds its
    arrays until written, so demoting the entry from RAM meanwhile freed nothing,
    and RAM + queue held more than the cache's budget."""
    import threading

    import kvcache.disk as disk_module

    gate = threading.Event()
    write = disk_module.write_atomic

    def held_back(path, parts):
        gate.wait(30)
        return write(path, parts)

    monkeypatch.setattr(disk_module, "write_atomic", held_back)
    budget = 4 * 2**20  # RAM tier 3 MiB, write queue 1 MiB
    config = PromptCacheConfig(block_size=16, kv_block_size=16, policy=VolatilePolicy.STRICT)
    m = TieredKVManager(
        config, budget, NS, [KVCache() for _ in range(LAYERS)], DiskConfig(tmp_path, GiB)
    )
    a, b = list(range(1000, 13_000)), list(range(100_000, 112_000))  # ~2.9 MiB of KV each

    def held() -> int:  # bytes alive: RAM entries, and queued writes of entries not in RAM
        queued = sum(e.nbytes for e in m.index.entries() if e.persisting and not e.in_ram)
        return m.index.ram.nbytes + queued

    try:
        first = store(m, a)
        assert m.disk.pending_bytes() > m.disk.max_pending_bytes  # alone, past the share
        assert m.store(PromptKey.build(b), caches_for(b), session="b") is None  # no room yet
        assert m.index.get(first).in_ram and held() <= budget
        gate.set()
        assert m.disk.flush()
        second = store(m, b, "b")  # written: the first leaves RAM for the disk
        entry = m.index.get(first)
        assert entry.on_disk and not entry.in_ram and m.index.get(second).in_ram
        assert held() <= budget
    finally:
        gate.set()
        m.close()


def test_an_entry_whose_shared_blocks_were_never_written_is_not_marked_on_disk(
    tmp_path, monkeypatch
):
    """B shares blocks with A, whose queued write was to write them; A's write
    fails on its data (the tier stays on): B was marked on disk without them,
    and lost at the next load or restart."""
    import kvcache.disk as disk_module

    encode = disk_module.encode
    calls = []

    def first_fails(arrays, meta, bf16=frozenset()):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("one entry's arrays")
        return encode(arrays, meta, bf16)

    monkeypatch.setattr(disk_module, "encode", first_fails)
    m = manager(tmp_path)
    shared = list(range(1000, 1064))  # four blocks of 16
    a, b = shared + list(range(2000, 2040)), shared + list(range(3000, 3040))
    first, second = store(m, a, "a"), store(m, b, "b")
    assert m.disk.flush()
    m.poll()
    assert m.disk.usable and not m.index.get(first).on_disk
    entry = m.index.get(second)
    assert not entry.on_disk and entry.in_ram  # RAM only, as it really is
    assert served(m, b + [1]) == (b, "ram")
    m.close()
    again = manager(tmp_path)
    assert again.restored == 0  # nothing on disk claimed it
    again.close()


def test_a_damaged_saved_list_keeps_its_sound_pins_and_the_server_starts(tmp_path):
    """A pin whose uid was a list stopped the manager (and the server) at start."""
    m = manager(tmp_path)
    store(m, list(range(500, 600)), session="kept")
    m.save_conversation("kept", "mine")
    assert m.disk.flush()
    m.close()
    path = tmp_path / NS / "saved.json"
    pins = json.loads(path.read_text())
    pins["bad"] = {"uid": ["x"], "title": None}
    pins["odd"] = {"uid": "0" * 32, "title": {"t": 1}, "saved_at": "now"}
    path.write_text(json.dumps(pins))
    again = manager(tmp_path)
    try:
        saved = {c.conversation_id: c for c in again.saved_conversations()}
        assert list(saved) == ["kept"] and saved["kept"].title == "mine"
    finally:
        again.close()


def test_saving_a_conversation_pins_its_latest_turn_not_a_side_requests(tmp_path):
    """A session's latest write may be a side request's (a client's title request):
    with no message structure to tell them apart a save pins the conversation's
    longest turn, whichever branch wrote last (test_saved_conversations has the
    chat turns' rule)."""
    m = manager(tmp_path)
    try:
        side = store(m, list(range(700, 760)), session="S")
        m.sessions.record_turn("S", ["title request"], [60], side)
        turn = store(m, list(range(800, 1200)), session="S")
        m.sessions.record_turn("S", ["system", "question"], [300, 400], turn)
        m.sessions.record_turn("S", ["title request", "again"], [60, 70], side)
        saved = m.save_conversation("S", "my work")
        assert saved.tokens == 400
    finally:
        m.close()


def test_saving_again_pins_the_turn_reached_since_and_lets_the_old_one_go(tmp_path):
    """A second save after more turns pinned the first save's turn again: the
    conversation's latest KV stayed evictable and a restart loaded the old turn."""
    m = manager(tmp_path)
    try:
        first_turn = list(range(500, 600))
        old = store(m, first_turn, session="S")
        assert m.save_conversation("S", "work").tokens == 100
        latest = store(m, first_turn + list(range(600, 900)), session="S")
        again = m.save_conversation("S", "work")
        assert again.tokens == 400 and m.load_conversation("S").tokens == 400
        m.flush()  # the earlier save stands until the new turn's write lands
        assert m.index.get(latest).pinned and not m.index.get(old).pinned
        assert [c.tokens for c in m.saved_conversations()] == [400]
    finally:
        m.close()


def test_a_second_server_on_the_same_kv_dir_leaves_the_first_ones_files_alone(tmp_path, caplog):
    """Its start-up sweep deleted the first server's temp files and its blocks not
    yet named by a manifest (writes in flight), turning the first one's tier off;
    the two also evicted each other's blocks. The second now serves from RAM only,
    saying why, and the folder is free again once the first closes."""
    first = manager(tmp_path)
    try:
        store(first, list(range(100, 164)))
        first.flush()
        files = sorted(p for p in (tmp_path / NS).rglob("*") if p.is_file())
        second = manager(tmp_path)
        try:
            assert second.disk is None
            assert "another kvwarm server uses" in caplog.text
            store(second, list(range(500, 564)))
            assert sorted(p for p in (tmp_path / NS).rglob("*") if p.is_file()) == files
        finally:
            second.close()
        assert first.disk is not None and first.disk.usable
    finally:
        first.close()
    third = manager(tmp_path)
    try:
        assert third.disk is not None and served(third, list(range(100, 164))) is not None
    finally:
        third.close()


def test_a_damaged_shared_block_takes_every_entry_naming_it_and_is_written_afresh(tmp_path):
    """Only the entry read was dropped: its neighbours kept the bad file, and a new
    entry of the same prefix was written pointing at it (the block 'was on disk'),
    so that prefix missed on disk for good, across restarts."""
    shared = list(range(300, 332))  # two blocks of 16
    a, b, c = (shared + list(range(base, base + 20)) for base in (400, 500, 600))
    m = manager(tmp_path)
    store(m, a)
    store(m, b)
    m.close()
    again = manager(tmp_path)
    (first, _) = next(e for e in again.index.entries()).held.blocks[0]
    path = again.disk.block_path(first)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert served(again, a + [1]) is None  # the damage is caught on read
    assert again.index.entries() == []  # b named the block too: gone with it
    store(again, c)
    again.close()
    assert path.exists()  # written afresh for c
    last = manager(tmp_path)
    try:
        tokens, tier = served(last, c + [1])
        assert tier == "disk" and tokens == c
    finally:
        last.close()


def test_other_namespaces_go_oldest_first_to_keep_the_dir_within_its_budget(tmp_path):
    """Every model switch or weights update left a namespace folder that nothing
    ever evicted: the dir grew by a whole budget per model. One with saved
    conversations, or one a running server holds, stays."""
    import os

    from kvcache.namespaces import prune_other_namespaces

    def namespace(name: str, size: int, age: int) -> Path:
        folder = tmp_path / name
        (folder / "entries").mkdir(parents=True)
        (folder / "blocks" / "ab").mkdir(parents=True)
        (folder / "blocks" / "ab" / "x.safetensors").write_bytes(b"\0" * size)
        (folder / ".lock").touch()
        os.utime(folder / ".lock", (age, age))
        return folder

    oldest, old, saved = namespace("a", 400, 1), namespace("b", 400, 2), namespace("c", 400, 0)
    (saved / "saved.json").write_text('{"conv": {"uid": "x"}}')
    held = manager(tmp_path, disk_bytes=1000)  # the namespace this server serves (NS)
    try:
        # 1200 of others over 1000: the oldest unsaved goes; then it is within
        assert not oldest.exists() and old.exists() and saved.exists()
        assert prune_other_namespaces(tmp_path, NS, 500) == ["b"]  # the next oldest
        assert (tmp_path / NS).exists()
        assert prune_other_namespaces(tmp_path, "another", 0) == []  # NS is held: it stays
        assert (tmp_path / NS).exists()
    finally:
        held.close()
    assert prune_other_namespaces(tmp_path, "another", 10**9) == []  # within budget: kept
    assert prune_other_namespaces(tmp_path, "another", 0) == [NS]


def test_a_namespace_whose_saved_list_cannot_be_read_is_kept(tmp_path):
    """A pins file that failed to read (its permissions, a disk error, a hand edit)
    counted as no pins: the conversations a user saved were deleted with it."""
    from kvcache.namespaces import prune_other_namespaces

    for name, pins in (("unreadable", "{not json"), ("empty", "{}"), ("none", None)):
        folder = tmp_path / name
        (folder / "entries").mkdir(parents=True)
        (folder / "blocks").mkdir()
        (folder / "blocks" / "x.safetensors").write_bytes(b"\0" * 100)
        if pins is not None:
            (folder / "saved.json").write_text(pins)
    assert sorted(prune_other_namespaces(tmp_path, "mine", 0)) == ["empty", "none"]
    assert (tmp_path / "unreadable").exists()


def test_the_start_up_sweep_stays_inside_the_namespace(tmp_path):
    """A torn saved-list write was never swept; and the orphan sweep followed a
    symlinked block shard, deleting files wherever it pointed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.safetensors").write_bytes(b"mine")
    root = tmp_path / "kv"
    manager(root).close()
    (root / NS / "blocks" / "ff").symlink_to(elsewhere)
    torn = root / NS / ".saved.json.tmp-99999"
    torn.write_text("{")
    manager(root).close()
    assert (elsewhere / "precious.safetensors").exists()
    assert not torn.exists()


def test_a_namespace_pruned_while_its_server_starts_comes_up_fresh(tmp_path, monkeypatch):
    """Its folders were made before its lock was taken: another server pruning old
    namespaces in that gap deleted the folder under it, and its tier went off.
    Moved aside under the lock, the old folder goes and the starting server makes
    its own, whichever comes first."""
    import fcntl
    import os

    import kvcache.disk as disk_module
    from kvcache.namespaces import prune_other_namespaces

    old = tmp_path / "F"
    (old / "blocks" / "ab").mkdir(parents=True)
    (old / "entries").mkdir()
    (old / "blocks" / "ab" / "x.safetensors").write_bytes(b"\0" * 5000)
    os.utime(old, (1, 1))
    real_flock = fcntl.flock
    pruned: list[list[str]] = []

    def flock_after_a_prune(fd, op):  # another server prunes F just before this lock
        if not pruned:
            pruned.append([])  # once: the prune's own lock is taken as usual
            pruned[0] = prune_other_namespaces(tmp_path, "N", 1000)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_prune)
    tier = disk_module.DiskTier(tmp_path, "F")
    try:
        assert pruned == [["F"]]  # the old folder went...
        assert tier.usable and (old / "blocks").is_dir() and (old / "entries").is_dir()
        assert not (old / "blocks" / "ab").exists()  # ...and this one is new, and held
        with open(old / ".lock", "a+b") as f, pytest.raises(BlockingIOError):
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        tier.close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".deleting-")]


def test_a_hit_whose_disk_read_fails_is_never_counted_then_taken_back(tmp_path):
    """The hit was counted before its KV was read from disk and subtracted when
    the read failed: a /metrics scrape during the read saw prefix_cache_hits_total
    go up, the next one down (a counter reset to Prometheus: a spike in every rate)."""
    from kvcache.disk import CorruptFile

    tokens = list(range(1000, 1050))
    first = manager(tmp_path)
    store(first, tokens)
    first.close()
    m = manager(tmp_path)
    during: list[tuple[int, int]] = []

    def torn(entry, keep=None):
        stats = m.stats()
        during.append((stats.hits, stats.disk_hits))
        raise CorruptFile("torn file")

    m.read_back = torn
    try:
        assert served(m, tokens + [1]) is None
        after = m.stats()
        assert during == [(0, 0)] and (after.hits, after.disk_hits, after.misses) == (0, 0, 1)
    finally:
        m.close()


def test_a_session_id_cannot_forge_a_prefix_cache_log_line(tmp_path, caplog):
    """The cache's hit and miss lines logged the client's session id raw: a newline
    in it wrote a line of the client's choosing into the plain-text log."""
    import logging

    forged = "s1\n2026-01-01 00:00:00 WARNING kvwarm.http: forged"
    m = manager(tmp_path)
    try:
        tokens = list(range(300, 364))
        with caplog.at_level(logging.INFO, logger="kvwarm"):
            for _ in range(2):  # a miss, then a hit
                reuse, _ = m.lookup("r", CacheHints(PromptKey.build(tokens), forged), 0)
                if reuse is not None:
                    m.release(reuse.entry_id)
                else:
                    store(m, tokens, session=forged)
        lines = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
        assert any("miss" in ln for ln in lines) and any("hit" in ln for ln in lines)
        assert all("\n" not in ln and "s1\\n2026" in ln for ln in lines)
    finally:
        m.close()


class _HeldWriter:
    """Holds the disk writer inside its next file write until ``open()``."""

    def __init__(self, monkeypatch):
        import threading

        from kvcache import disk

        self.gate = threading.Event()
        self.real = disk.write_atomic
        self.write = self.real

        def held(path, parts):
            self.gate.wait(10)
            return self.write(path, parts)

        monkeypatch.setattr(disk, "write_atomic", held)

    def open(self) -> None:
        self.gate.set()


def test_loading_a_conversation_whose_write_is_queued_keeps_it(tmp_path, monkeypatch):
    """Out of RAM with its write still queued, a saved conversation's load read
    files not yet written, called them damaged and discarded it, saved and all."""
    config = PromptCacheConfig(
        block_size=16, kv_block_size=16, policy=VolatilePolicy.STRICT, max_entries=1
    )
    m = TieredKVManager(
        config, GiB, NS, [KVCache() for _ in range(LAYERS)], DiskConfig(tmp_path, GiB)
    )
    writer = _HeldWriter(monkeypatch)
    saved = store(m, list(range(1000, 1100)), "conv")
    store(m, list(range(5000, 5100)), "other")  # one entry in RAM: the first leaves it
    m.save_conversation("conv", "mine")  # saved once out of RAM, its write queued
    entry = m.index.get(saved)
    assert not entry.in_ram and entry.persisting and not entry.on_disk
    assert m.load_conversation("conv").tier == "writing"
    writer.open()
    m.close()
    again = manager(tmp_path)
    assert [c.conversation_id for c in again.saved_conversations()] == ["conv"]
    assert served(again, list(range(1000, 1101))) == (list(range(1000, 1100)), "disk")


def test_the_end_of_a_write_dropped_while_queued_does_not_mark_a_later_one_done(
    tmp_path, monkeypatch
):
    """Completions were matched by entry id: the first write's success marked the
    entry on disk though its second write failed, files and ledger apart."""
    import errno

    m = manager(tmp_path)
    writer = _HeldWriter(monkeypatch)
    entry_id = store(m, list(range(1000, 1100)))  # write 1 queued, the writer held
    entry = m.index.get(entry_id)
    m.index.lose_block(entry.held.blocks[0][0])  # its disk copy is dropped (stays in RAM)
    assert m.persist(entry_id)  # write 2, queued behind write 1 and its delete
    writes = {"n": 0}

    def second_fails(path, parts):
        writes["n"] += 1
        if writes["n"] > 1 + len(entry.held.blocks):  # write 1: blocks + entry file
            raise OSError(errno.ENOSPC, "full")
        return writer.real(path, parts)

    writer.write = second_fails
    writer.open()
    m.flush()
    assert not m.disk.entry_path(entry.uid).exists()
    assert not entry.on_disk and not entry.persisting and m.index.disk.nbytes == 0


def test_a_saved_list_the_full_disk_refused_is_written_again(tmp_path, monkeypatch):
    """saved.json's write failed once (ENOSPC) after the save was acknowledged:
    never retried, the conversation came back unpinned after a restart."""
    import errno

    from kvcache import disk

    m = manager(tmp_path)
    real = disk.write_atomic

    def no_room_for_pins(path, parts):
        if path.name == "saved.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, parts)

    monkeypatch.setattr(disk, "write_atomic", no_room_for_pins)
    store(m, list(range(1000, 1100)), "conv")
    m.save_conversation("conv", "mine")
    m.flush()
    monkeypatch.setattr(disk, "write_atomic", real)  # room again
    store(m, list(range(3000, 3100)), "next")  # the next entry written brings the list
    m.flush()
    assert json.loads(m.disk.pins_path.read_text())["conv"]["title"] == "mine"
    m.close()
    again = manager(tmp_path)
    assert [c.conversation_id for c in again.saved_conversations()] == ["conv"]


def test_a_conversation_deleted_while_a_turn_reads_it_is_served_to_no_one_after(tmp_path):
    """An entry being read was only marked when its conversation was deleted:
    every later request (of any session) was still served the deleted KV."""
    tokens = list(range(1000, 1100))
    m = manager(tmp_path)
    try:
        entry_id = store(m, tokens, "conv")
        reader, _ = m.lookup("turn", CacheHints(PromptKey.build(tokens + [1]), "conv"), 0)
        assert reader is not None and reader.entry_id == entry_id
        m.delete_conversation("conv")
        assert served(m, tokens + [2]) is None
        assert reader.caches[0].keys[0, 0, :100, 0].tolist() == tokens  # the reader's own
        m.release(reader.entry_id)
        assert entry_id not in m.index
    finally:
        m.close()


def test_a_conversation_deleted_while_a_turn_reads_it_leaves_the_disk_at_once(tmp_path):
    """Its files stayed until the reader let go: a crash before that brought the
    deleted conversation's KV back after the restart, served to anyone."""
    tokens = list(range(1000, 1100))
    m = manager(tmp_path)
    store(m, tokens, "conv")
    m.save_conversation("conv", "secret")
    m.flush()
    reader, _ = m.lookup("turn", CacheHints(PromptKey.build(tokens + [1]), "conv"), 0)
    assert reader is not None
    m.delete_conversation("conv")
    m.flush()
    assert entry_files(tmp_path) == [] and block_files(tmp_path) == []
    assert m.index.disk.nbytes == 0
    m.close()  # the process stops before the turn lets go
    again = manager(tmp_path)
    try:
        assert again.restored == 0 and served(again, tokens + [2]) is None
        assert again.saved_conversations() == []
    finally:
        again.close()


def _entry_files_fail(monkeypatch) -> None:
    """Every entry file write fails (the disk is full); saved.json still writes."""
    import errno

    from kvcache import disk

    real = disk.write_atomic

    def full(path, parts):
        if path.parent.name == "entries":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, parts)

    monkeypatch.setattr(disk, "write_atomic", full)


def test_a_save_whose_write_fails_is_taken_back_and_said_so(tmp_path, monkeypatch, caplog):
    """A save acknowledged while its write was queued stayed listed (and in
    saved.json) after the write failed, with nothing on disk: RAM pressure then
    dropped the KV, and no error was logged anywhere."""
    tokens = list(range(1000, 1100))
    m = manager(tmp_path)
    _entry_files_fail(monkeypatch)
    entry_id = store(m, tokens, "conv")
    assert m.save_conversation("conv", "mine").tier == "ram"
    m.flush()  # the write fails
    m.flush()  # saved.json is written again
    try:
        assert m.saved_conversations() == []
        assert json.loads(m.disk.pins_path.read_text()) == {}
        entry = m.index.get(entry_id)
        assert entry is not None and entry.in_ram and not entry.pinned
        assert served(m, tokens + [1]) == (tokens, "ram")  # still cached, as any entry
        assert any(r.levelname == "ERROR" and "conv" in r.getMessage() for r in caplog.records)
    finally:
        m.close()


def test_a_saved_entry_stays_in_ram_until_its_write_lands(tmp_path, monkeypatch):
    """A saved entry pushed out of RAM with its write still queued was lost for
    good when that write failed."""
    config = PromptCacheConfig(
        block_size=16, kv_block_size=16, policy=VolatilePolicy.STRICT, max_entries=1
    )
    m = TieredKVManager(
        config, GiB, NS, [KVCache() for _ in range(LAYERS)], DiskConfig(tmp_path, GiB)
    )
    writer = _HeldWriter(monkeypatch)
    tokens = list(range(1000, 1100))
    saved = store(m, tokens, "conv")
    m.save_conversation("conv", "mine")
    other = list(range(5000, 5100))
    m.store(PromptKey.build(other), caches_for(other), session="other")
    assert m.index.get(saved).in_ram
    writer.write = lambda path, parts: (_ for _ in ()).throw(OSError(28, "full"))
    writer.open()
    m.flush()
    try:
        assert served(m, tokens + [1]) == (tokens, "ram")
    finally:
        m.close()


def test_deleting_a_save_whose_kv_is_gone_drops_it(tmp_path):
    """A save whose KV was discarded (damaged on disk) could not be deleted: 404,
    and its pin stayed in saved.json. The damage found takes the save back now:
    no pin is left to delete."""
    tokens = list(range(1000, 1100))
    m = manager(tmp_path)
    store(m, tokens, "conv")
    m.save_conversation("conv", "mine")
    m.close()
    again = manager(tmp_path)
    (first, _) = again.index.entries()[0].held.blocks[0]
    path = again.disk.block_path(first)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert again.load_conversation("conv").tier == "loading"
    try:
        again.flush()  # the read done: the damage is found on the engine thread
        assert again.conversations.pins == {} and again.saved_conversations() == []
        with pytest.raises(ConversationNotFound):
            again.delete_conversation("conv")
    finally:
        again.close()
    assert json.loads(again.disk.pins_path.read_text()) == {}


def test_a_store_whose_copy_fails_leaves_nothing_indexed_or_reserved(tmp_path, monkeypatch):
    """The entry was indexed, its disk bytes reserved, before its KV was copied: a
    copy that raised (out of memory) left it with no payload and no write queued,
    persisting for good, its reservation leaked, and nothing evicted it."""
    tokens = list(range(1000, 1100))
    m = manager(tmp_path)
    try:

        def out_of_memory(*args, **kwargs):
            raise MemoryError("[malloc] Unable to allocate")

        monkeypatch.setattr(m.ops, "split", out_of_memory)
        with pytest.raises(MemoryError):
            m.store(PromptKey.build(tokens), caches_for(tokens), session="s")
        assert m.index.entries() == []
        assert m.index.nbytes == m.index.disk.nbytes == 0
        monkeypatch.undo()
        store(m, tokens)  # the next store of those tokens is kept and written
        m.flush()
        assert served(m, tokens + [1]) == (tokens, "ram")
        assert [e.on_disk for e in m.index.entries()] == [True]
    finally:
        m.close()


def test_a_manifest_whose_key_cannot_be_read_takes_its_blocks_along(tmp_path):
    entry = one_entry_on_disk(tmp_path, list(range(1000, 1100)))
    rewrite(entry, b'model_tokens\\":[1000,', b'model_tokens\\":[null,')
    m = manager(tmp_path)
    m.flush()
    assert m.restored == 0 and entry_files(tmp_path) == [] and block_files(tmp_path) == []


def _crafted(path: Path, tensors: dict, data: bytes) -> None:
    """A file whose checksum and namespace are right, whatever its tensors say."""
    header = dict(tensors)
    meta = {"namespace": "n", "nbytes": str(len(data))}
    header["__metadata__"] = meta
    meta["crc32"] = str(zlib.crc32(safetensors_io._unsigned(header), zlib.crc32(data)))
    text = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(
    "tensors, nbytes",
    [
        # 200 names over the same bytes: a 4 KiB file read as 800 KiB
        ({f"t{i}": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]} for i in range(200)}, 4096),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 8),  # bytes left over
        ({"x": {"dtype": "F32", "shape": [0, 2**40], "data_offsets": [0, 0]}}, 0),  # overflows MLX
    ],
)  # fmt: skip
def test_tensors_must_tile_the_data_within_sane_shapes(tmp_path, tensors, nbytes):
    path = tmp_path / "f.safetensors"
    _crafted(path, tensors, bytes(nbytes))
    with pytest.raises(safetensors_io.CorruptFile, match="bad tensor entry"):
        safetensors_io.read_verified(path, "n")


@pytest.mark.parametrize("own", [True, False])
def test_whether_an_entrys_session_was_its_own_survives_a_restart(tmp_path, own):
    """Restored entries read back as nobody's own: after a restart a conversation
    prefilled again the reminders only its entry held (a miss, not a wrong answer)."""
    tokens = list(range(1000, 1100))
    m = manager(tmp_path)
    m.store(PromptKey.build(tokens), caches_for(tokens), session="c-1", own_session=own)
    m.close()
    again = manager(tmp_path)
    (entry,) = again.index.entries()
    assert (entry.session, entry.own_session) == ("c-1", own)
    again.close()


def _two_entries_sharing_a_prefix_one_saved(root: Path) -> tuple[list[int], list[int]]:
    """Entries ``a`` and ``b`` on disk sharing four blocks; ``b`` saved as "B"."""
    shared = list(range(100, 164))
    a, b = shared + list(range(1000, 1040)), shared + list(range(2000, 2040))
    m = manager(root)
    store(m, a, "A")
    store(m, b, "B")
    m.flush()
    m.save_conversation("B", "keep me")
    m.close()
    return a, b


def _block_reads_fail(monkeypatch, exc: BaseException) -> list[Path]:
    """The next read of a block file raises ``exc`` (once); returns the paths tried."""
    real = safetensors_io.open_regular
    failed: list[Path] = []

    def flaky(path):
        if "blocks" in path.parts and not failed:
            failed.append(path)
            raise exc
        return real(path)

    monkeypatch.setattr(safetensors_io, "open_regular", flaky)
    return failed


def _files(root: Path) -> list[Path]:
    return entry_files(root) + block_files(root)


@pytest.mark.parametrize("errno_name", ["EMFILE", "ENFILE", "EIO", "EACCES", "EAGAIN", "ENOMEM"])
def test_a_read_error_that_may_pass_is_a_miss_and_deletes_nothing(
    tmp_path, monkeypatch, errno_name
):
    """One EMFILE while reading a shared block was taken for damage: the good block
    and every entry naming it, a saved conversation's included, were deleted."""
    import errno

    a, b = _two_entries_sharing_a_prefix_one_saved(tmp_path)
    files = _files(tmp_path)
    m = manager(tmp_path)
    try:
        code = getattr(errno, errno_name)
        failed = _block_reads_fail(monkeypatch, OSError(code, os.strerror(code)))
        assert served(m, a + [7]) is None  # a miss for this lookup...
        assert failed
        assert len(m.index.entries()) == 2 and all(e.refs == 0 for e in m.index.entries())
        assert [c.conversation_id for c in m.saved_conversations()] == ["B"]
        m.flush()
        assert _files(tmp_path) == files  # ...and nothing deleted
        assert served(m, a + [7]) == (a, "disk")  # the next read works
    finally:
        m.close()
    again = manager(tmp_path)
    try:
        assert again.restored == 2
        assert [c.conversation_id for c in again.saved_conversations()] == ["B"]
    finally:
        again.close()


@pytest.mark.parametrize("exc", [MemoryError(), RuntimeError("[metal] out of memory")])
def test_a_load_that_runs_out_of_memory_is_a_miss_and_deletes_nothing(tmp_path, monkeypatch, exc):
    a, b = _two_entries_sharing_a_prefix_one_saved(tmp_path)
    files = _files(tmp_path)
    m = manager(tmp_path)
    try:

        def no_memory(raw):
            raise exc

        monkeypatch.setattr("kvcache.manager.mlx_arrays", no_memory)
        assert served(m, b + [7]) is None
        assert m.load_conversation("B").tier == "loading"
        m.flush()
        assert [c.tier for c in m.saved_conversations()] == ["disk"]  # not loaded, saved
        monkeypatch.undo()
        assert _files(tmp_path) == files
        assert len(m.index.entries()) == 2
        m.load_conversation("B")
        m.flush()
        assert m.load_conversation("B").tier == "ram+disk"
    finally:
        m.close()


def test_loading_a_save_through_a_read_error_that_may_pass_keeps_it(tmp_path, monkeypatch):
    import errno

    a, b = _two_entries_sharing_a_prefix_one_saved(tmp_path)
    files = _files(tmp_path)
    m = manager(tmp_path)
    try:
        _block_reads_fail(monkeypatch, OSError(errno.EIO, "Input/output error"))
        m.load_conversation("B")
        m.flush()
        assert m.load_conversation("B").tier == "loading"  # raised ConversationNotFound before
        m.flush()
        assert _files(tmp_path) == files
        assert m.load_conversation("B").tier == "ram+disk"
    finally:
        m.close()


def test_a_block_file_that_is_gone_is_still_damage(tmp_path):
    a, b = _two_entries_sharing_a_prefix_one_saved(tmp_path)
    m = manager(tmp_path)
    try:
        (first, _) = m.index.entries()[0].held.blocks[0]
        m.disk.block_path(first).unlink()
        assert served(m, a + [7]) is None
        assert m.index.entries() == []  # both named the block: both gone
    finally:
        m.close()


def _saved_on_disk(root: Path, tokens: list[int], conversation: str = "S") -> int:
    """``tokens``' KV saved as ``conversation`` by a server that then stops; its size."""
    m = manager(root)
    entry_id = store(m, tokens, conversation)
    m.flush()
    m.save_conversation(conversation, "important")
    size = m.index.get(entry_id).held.total
    m.close()
    return size


def _saved_ids(m: TieredKVManager) -> list[str]:
    return [c.conversation_id for c in m.saved_conversations()]


@pytest.mark.parametrize("change", ["smaller budget", "other kv block size"])
def test_a_save_a_restart_cannot_index_keeps_its_files_for_a_later_one(tmp_path, caplog, change):
    """An automatic disk budget shrinks as the disk fills, and --kv-block-size may
    change: the restart deleted the saved conversation's files for good."""
    tokens = list(range(100, 400))
    size = _saved_on_disk(tmp_path, tokens)
    files = _files(tmp_path)
    pins = json.loads((tmp_path / NS / "saved.json").read_text())
    budget, block = (size // 2, 16) if change == "smaller budget" else (GiB, 32)
    smaller = manager(tmp_path, kv_block=block, disk_bytes=budget)
    try:
        smaller.flush()
        assert smaller.restored == 0 and _saved_ids(smaller) == []  # not served...
        assert _files(tmp_path) == files  # ...but kept
        assert any(r.levelname == "WARNING" and "1 saved" in r.getMessage() for r in caplog.records)
        other = list(range(5000, 5040))
        store(smaller, other, "T")
        smaller.flush()
        smaller.save_conversation("T", "another")  # rewrites saved.json
        smaller.flush()
        smaller.delete_conversation("T")
        smaller.flush()
    finally:
        smaller.close()
    assert json.loads((tmp_path / NS / "saved.json").read_text()) == pins
    back = manager(tmp_path)
    try:
        assert _saved_ids(back) == ["S"]
        assert served(back, tokens + [1]) == (tokens, "disk")
    finally:
        back.close()


def test_blocks_a_kept_save_shares_stay_when_the_entries_restored_beside_it_go(tmp_path):
    shared = list(range(100, 164))
    saved, plain = shared + list(range(1000, 1100)), shared + list(range(2000, 2010))
    m = manager(tmp_path)
    store(m, plain, "P")
    entry_id = store(m, saved, "S")
    m.flush()
    m.save_conversation("S", "important")
    size = m.index.get(entry_id).held.total
    m.close()
    small = manager(tmp_path, disk_bytes=size - 1)  # the save does not fit; the other does
    try:
        assert small.restored == 1 and _saved_ids(small) == []
        small.delete_conversation("P")  # the restored entry sharing its blocks goes
        small.flush()
    finally:
        small.close()
    back = manager(tmp_path)
    try:
        assert _saved_ids(back) == ["S"]
        assert served(back, saved + [1]) == (saved, "disk")
    finally:
        back.close()


DEEP = b"[" * 100_000  # JSON nested past Python's recursion limit


def test_a_kv_dir_that_cannot_be_listed_at_start_turns_the_tier_off(tmp_path, monkeypatch, caplog):
    """An I/O error listing the dir (EIO, EACCES on blocks/) stopped the server's
    start, on every restart."""
    import errno
    import pathlib

    tokens = list(range(100, 200))
    _saved_on_disk(tmp_path, tokens)
    files = _files(tmp_path) + [tmp_path / NS / "saved.json"]
    real = pathlib.Path.iterdir

    def denied(self):
        if self.name == "blocks":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(pathlib.Path, "iterdir", denied)
    m = manager(tmp_path)  # raised PermissionError before
    try:
        assert m.disk is not None and not m.disk.usable
        assert "Permission denied" in (m.disk.degraded or "")
        assert m.restored == 0 and m.index.entries() == [] and not m.stats().disk_enabled
        assert any(r.levelname == "ERROR" and "off" in r.getMessage() for r in caplog.records)
        assert store(m, tokens, "S") is not None  # RAM only
        assert served(m, tokens + [1]) == (tokens, "ram")
        with pytest.raises(StorageFull):
            m.save_conversation("S", "again")
        m.flush()
    finally:
        m.close()
    monkeypatch.undo()
    assert _files(tmp_path) + [tmp_path / NS / "saved.json"] == files  # nothing touched
    again = manager(tmp_path)
    try:
        assert _saved_ids(again) == ["S"]
    finally:
        again.close()


def test_an_entry_header_nested_too_deep_is_discarded_at_start(tmp_path):
    tokens = list(range(100, 200))
    one_entry_on_disk(tmp_path, tokens)
    hostile = tmp_path / NS / "entries" / "x.safetensors"
    hostile.write_bytes(struct.pack("<Q", len(DEEP)) + DEEP)
    m = manager(tmp_path)  # raised RecursionError before
    try:
        assert m.disk.usable and m.restored == 1 and not hostile.exists()
    finally:
        m.close()


def test_a_saved_list_nested_too_deep_does_not_stop_the_start(tmp_path):
    (tmp_path / NS).mkdir()
    (tmp_path / NS / "saved.json").write_bytes(DEEP)
    m = manager(tmp_path)  # raised RecursionError before
    try:
        assert m.disk.usable and _saved_ids(m) == []
    finally:
        m.close()


def test_a_file_whose_header_or_manifest_is_nested_too_deep_is_corrupt(tmp_path):
    path = tmp_path / "f.safetensors"
    path.write_bytes(struct.pack("<Q", len(DEEP)) + DEEP)
    with pytest.raises(safetensors_io.CorruptFile):
        safetensors_io.read_verified(path, "n")
    from kvcache.disk import DiskTier

    tier = DiskTier(tmp_path, "n")
    try:
        deep = "[" * 100_000
        data = safetensors_io.encode({"a": np.zeros(2)}, {"namespace": "n", "manifest": deep})
        safetensors_io.write_atomic(tier.entry_path("e"), data)
        with pytest.raises(safetensors_io.CorruptFile):
            tier.read_entry("e")
    finally:
        tier.close()


def test_another_namespaces_saved_list_nested_too_deep_counts_as_saves(tmp_path):
    from kvcache.namespaces import prune_other_namespaces

    other = tmp_path / "other"
    (other / "blocks").mkdir(parents=True)
    (other / "entries").mkdir()
    (other / "saved.json").write_bytes(DEEP)
    assert prune_other_namespaces(tmp_path, "mine", 0) == []  # raised RecursionError before
    assert other.exists()


def test_a_weights_digest_memo_nested_too_deep_is_read_as_none(tmp_path):
    import hashlib

    from engine.file_digest import content_digest

    weights, memo = tmp_path / "w.safetensors", tmp_path / ".weights-digests.json"
    weights.write_bytes(b"x")
    memo.write_bytes(b'{"a":' * 100_000)
    assert content_digest(weights, memo) == hashlib.sha256(b"x").hexdigest()


def _finishes(call, seconds: float = 5.0) -> bool:
    """Whether ``call`` returns within ``seconds`` (run on a daemon thread)."""
    import threading

    done = threading.Event()

    def run():
        call()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(seconds)


def _unblock(fifo: Path) -> None:
    """Let a reader blocked opening ``fifo`` go on (it then reads nothing)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader is waiting


def test_a_fifo_among_the_entries_does_not_block_the_start(tmp_path):
    tokens = list(range(100, 200))
    one_entry_on_disk(tmp_path, tokens)
    fifo = tmp_path / NS / "entries" / "x.safetensors"
    os.mkfifo(fifo)
    started: list[TieredKVManager] = []
    try:
        assert _finishes(lambda: started.append(manager(tmp_path)))  # blocked in open()
        (m,) = started
        assert m.restored == 1 and not fifo.exists()
        m.close()
    finally:
        _unblock(fifo)


def test_a_fifo_in_place_of_a_block_is_damage_not_a_wait(tmp_path):
    tokens = list(range(100, 200))
    one_entry_on_disk(tmp_path, tokens)
    m = manager(tmp_path)
    (digest, _) = m.index.entries()[0].held.blocks[0]
    fifo = m.disk.block_path(digest)
    fifo.unlink()
    os.mkfifo(fifo)
    got: list[object] = []
    try:
        assert _finishes(lambda: got.append(served(m, tokens + [1])))
        assert got == [None] and m.index.entries() == []
    finally:
        _unblock(fifo)
        m.close()


def test_a_symlink_or_an_oversized_file_is_damage_never_read_whole(tmp_path, monkeypatch):
    """A block symlinked to /dev/zero, or a huge file, was read until memory ran out."""
    import pathlib

    a, b = list(range(100, 200)), list(range(3000, 3100))
    m = manager(tmp_path)
    store(m, a, "A")
    store(m, b, "B")
    m.close()
    m = manager(tmp_path)
    try:
        entries = {e.session: e for e in m.index.entries()}
        zero = m.disk.block_path(entries["A"].held.blocks[0][0])
        zero.unlink()
        zero.symlink_to("/dev/zero")
        huge = m.disk.entry_path(entries["B"].uid)
        with open(huge, "r+b") as f:
            f.truncate(8 * GiB)  # sparse: no disk used
        real = pathlib.Path.read_bytes

        def out_of_memory(self):  # what reading either whole comes to
            if self in (zero, huge):
                raise MemoryError
            return real(self)

        monkeypatch.setattr(pathlib.Path, "read_bytes", out_of_memory)
        assert served(m, a + [1]) is None and served(m, b + [1]) is None
        assert m.index.entries() == []  # damage: discarded, not kept as a read that may pass
    finally:
        m.close()


def test_a_block_shard_symlinked_to_another_folder_is_still_read(tmp_path):
    tokens = list(range(100, 200))
    one_entry_on_disk(tmp_path, tokens)
    shard = block_files(tmp_path)[0].parent
    moved = tmp_path / "elsewhere"
    shard.rename(moved)
    shard.symlink_to(moved)
    m = manager(tmp_path)
    try:
        assert m.restored == 1
        assert served(m, tokens + [1]) == (tokens, "disk")
    finally:
        m.close()


@pytest.mark.parametrize("damage", [b"{not json", b"[1, 2]", DEEP])
def test_a_saved_list_that_cannot_be_parsed_is_moved_aside_not_overwritten(
    tmp_path, caplog, damage
):
    """It was read as no saves: the next save overwrote the old pins for good."""
    from kvcache.namespaces import prune_other_namespaces

    tokens = list(range(100, 200))
    _saved_on_disk(tmp_path, tokens)
    path = tmp_path / NS / "saved.json"
    path.write_bytes(damage)
    m = manager(tmp_path)
    try:
        assert _saved_ids(m) == []
        store(m, list(range(5000, 5040)), "T")
        m.save_conversation("T", "new")  # writes saved.json afresh
        m.flush()
        assert any(
            r.levelname == "ERROR" and "saved.json.bad" in r.getMessage() for r in caplog.records
        )
    finally:
        m.close()
    assert (tmp_path / NS / "saved.json.bad").read_bytes() == damage
    assert list(json.loads(path.read_text())) == ["T"]
    path.unlink()  # another namespace whose only list is the one moved aside keeps it
    assert prune_other_namespaces(tmp_path, "another", 0) == []


def test_a_saved_list_that_cannot_be_read_now_turns_the_tier_off_for_the_run(tmp_path, monkeypatch):
    import errno
    import pathlib

    _saved_on_disk(tmp_path, list(range(100, 200)))
    path = tmp_path / NS / "saved.json"
    before = path.read_bytes()
    real = pathlib.Path.read_text

    def eio(self, *args, **kwargs):
        if self == path:
            raise OSError(errno.EIO, "Input/output error")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", eio)
    m = manager(tmp_path)
    try:
        assert not m.disk.usable  # not read as "no saves", to be overwritten by the next
    finally:
        m.close()
    monkeypatch.undo()
    assert path.read_bytes() == before
    again = manager(tmp_path)
    try:
        assert _saved_ids(again) == ["S"]
    finally:
        again.close()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fd through /proc")
def test_an_entry_and_the_saved_list_are_durable_once_written(tmp_path, monkeypatch):
    """The file was fsynced, never the folder after the rename: after a power loss
    an acknowledged entry or saved list could be gone."""
    synced: list[Path] = []
    real = os.fsync

    def spy(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    m = manager(tmp_path)
    try:
        store(m, list(range(100, 200)), "S")
        m.flush()
        assert (tmp_path / NS / "entries").resolve() in synced
        m.save_conversation("S", "mine")
        m.flush()
        assert (tmp_path / NS).resolve() in synced  # saved.json's folder
    finally:
        m.close()


def test_a_folder_that_cannot_be_synced_is_no_error(tmp_path):
    safetensors_io.sync_dir(tmp_path / "gone")  # as on a platform that cannot open folders


@pytest.mark.parametrize("errno_name", ["EIO", "EACCES", "EMFILE"])
def test_an_entry_unreadable_at_start_for_now_is_kept_with_its_blocks(
    tmp_path, monkeypatch, caplog, errno_name
):
    """The start-up scan took an entry whose header could not be read this time (EIO,
    EACCES, EMFILE) for damage: it deleted the file, and the sweep after it every
    block only that entry named, a saved conversation's included."""
    import errno

    from kvcache import disk

    a, b = _two_entries_sharing_a_prefix_one_saved(tmp_path)
    files = _files(tmp_path)
    real = disk.open_regular
    code = getattr(errno, errno_name)

    def flaky(path):
        if "entries" in path.parts:
            raise OSError(code, os.strerror(code))
        return real(path)

    monkeypatch.setattr(disk, "open_regular", flaky)
    m = manager(tmp_path)
    try:
        assert m.restored == 0  # nothing it could read...
        m.flush()
    finally:
        m.close()
    assert _files(tmp_path) == files  # ...and nothing deleted
    assert "could not be read" in caplog.text
    monkeypatch.setattr(disk, "open_regular", real)
    again = manager(tmp_path)
    try:
        assert again.restored == 2
        assert [c.conversation_id for c in again.saved_conversations()] == ["B"]
        assert served(again, b + [7]) == (b, "disk")
    finally:
        again.close()


def _assembly_fails(monkeypatch, m: TieredKVManager) -> None:
    def broken(self, *args, **kw):  # the entry's own arrays do not fit together
        raise ValueError("shapes do not broadcast")

    monkeypatch.setattr(type(m.ops), "assemble", broken)


def test_an_entry_in_ram_that_cannot_be_assembled_is_discarded_not_kept(
    tmp_path, monkeypatch, caplog
):
    """Any error but damage was taken for a disk read that may pass: an entry in RAM
    whose assembly failed stayed the best hit with no ref, and every lookup missed."""
    tokens = list(range(1000, 1050))
    m = manager(tmp_path)
    try:
        store(m, tokens)
        m.flush()
        _assembly_fails(monkeypatch, m)
        assert served(m, tokens + [1]) is None
        assert m.index.entries() == []  # discarded: the next lookup does not hit it
        assert served(m, tokens + [1]) is None
        st = m.stats()
        assert (st.hits, st.misses) == (0, 2)
        assert "in RAM" in caplog.text and "on disk" not in caplog.text
        monkeypatch.undo()
        store(m, tokens)
        assert served(m, tokens + [1]) == (tokens, "ram")
    finally:
        m.close()


@pytest.mark.parametrize("defer", [False, True])
def test_a_disk_entry_read_whole_that_cannot_be_assembled_is_discarded(
    tmp_path, monkeypatch, defer
):
    tokens = list(range(1000, 1050))
    one_entry_on_disk(tmp_path, tokens)
    m = manager(tmp_path)
    try:
        _assembly_fails(monkeypatch, m)
        assert served(m, tokens + [1], defer) is None
        assert m.index.entries() == []
        m.flush()
        assert _files(tmp_path) == []
        st = m.stats()
        assert (st.hits, st.misses, st.disk_files_discarded) == (0, 1, 1)
    finally:
        m.close()


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize(
    "exc, kept",
    [
        (MemoryError(), True),
        (RuntimeError("[metal::malloc] Unable to allocate 4096 bytes"), True),
        (RuntimeError("[METAL] Command buffer execution failed: Insufficient Memory"), True),
        (OSError(5, "Input/output error"), True),
        (FileNotFoundError(2, "gone"), False),
        (RuntimeError("[reshape] Cannot reshape array"), False),
    ],
)
def test_only_a_disk_read_that_may_pass_keeps_the_entry(tmp_path, monkeypatch, defer, exc, kept):
    tokens = list(range(1000, 1050))
    one_entry_on_disk(tmp_path, tokens)
    files = _files(tmp_path)
    m = manager(tmp_path)
    try:

        def fails(raw):  # while converting the files read to MLX arrays
            raise exc

        monkeypatch.setattr("kvcache.manager.mlx_arrays", fails)
        assert served(m, tokens + [1], defer) is None
        monkeypatch.undo()
        m.flush()
        if kept:
            assert _files(tmp_path) == files and m.index.entries()[0].refs == 0
            assert served(m, tokens + [1], defer) == (tokens, "disk")
        else:
            assert m.index.entries() == [] and _files(tmp_path) == []
    finally:
        m.close()


def _probe(m: TieredKVManager, tokens: list[int], request_id: str = "r"):
    hints = CacheHints(PromptKey.build(tokens + [1]), "probe")
    return m.lookup(request_id, hints, max_growth=0, defer_disk=True)[0]


@pytest.mark.parametrize("where", ["poll", "served", "assemble"])
def test_a_finished_read_that_raises_gives_its_entry_back_once(tmp_path, monkeypatch, where):
    """finish_read marked the ref given back before poll() and the hit's counting:
    either raising left the entry held for good (never evicted, never deleted)."""
    tokens = list(range(1000, 1050))
    one_entry_on_disk(tmp_path, tokens)
    m = manager(tmp_path)
    try:
        first, second = _probe(m, tokens, "r1"), _probe(m, tokens, "r2")
        assert isinstance(first, PendingHit) and isinstance(second, PendingHit)
        assert first.ticket.wait(5) and second.ticket.wait(5)
        (entry,) = m.index.entries()
        assert entry.refs == 2

        def boom(*args, **kw):
            raise KeyboardInterrupt("stop") if where == "assemble" else RuntimeError("a bug")

        owner = {"poll": m, "served": m.index, "assemble": m}[where]
        name = "_assemble" if where == "assemble" else where
        monkeypatch.setattr(owner, name, boom)
        with pytest.raises((RuntimeError, KeyboardInterrupt)):
            m.finish_read(first)
        assert entry.refs == 1  # its own ref given back, the other row's kept
        m.cancel_read(first)  # the row's clean-up after the failure: nothing more
        assert entry.refs == 1
        monkeypatch.undo()
        m.cancel_read(second)
        assert entry.refs == 0
    finally:
        m.close()


def test_a_hit_that_raises_while_counted_gives_its_entry_back(tmp_path, monkeypatch):
    tokens = list(range(1000, 1050))
    m = manager(tmp_path)
    try:
        store(m, tokens)

        def boom(result):
            raise RuntimeError("a bug")

        monkeypatch.setattr(m.index, "served", boom)
        with pytest.raises(RuntimeError):
            served(m, tokens + [1])
        assert m.index.entries()[0].refs == 0
    finally:
        m.close()


class _CountedReads:
    """The disk tier's entry reads, counted, each held until ``gate`` opens."""

    def __init__(self, disk, fail: BaseException | None = None):
        self.calls = 0
        self.gate = threading.Event()
        self._read, self._fail = disk.read_entry, fail

    def __call__(self, *args, **kw):
        self.calls += 1
        assert self.gate.wait(5)
        if self._fail is not None:
            raise self._fail
        return self._read(*args, **kw)


def _shared_read_setup(tmp_path, monkeypatch, fail=None):
    tokens = list(range(1000, 1050))
    one_entry_on_disk(tmp_path, tokens)
    m = manager(tmp_path)
    reads = _CountedReads(m.disk, fail)
    monkeypatch.setattr(m.disk, "read_entry", reads)
    return m, tokens, reads


def test_rows_hitting_one_disk_entry_share_one_read(tmp_path, monkeypatch):
    """Two rows on one disk-only entry (sub-agents after a restart) each read its
    files: double the I/O, and a second transient copy of the KV."""
    m, tokens, reads = _shared_read_setup(tmp_path, monkeypatch)
    try:
        first = _probe(m, tokens, "r1")
        second = _probe(m, tokens, "r2")
        assert isinstance(first, PendingHit) and isinstance(second, PendingHit)
        (entry,) = m.index.entries()
        assert entry.refs == 2  # each row holds its own
        reads.gate.set()
        assert first.ticket.wait(5)
        late = _probe(m, tokens, "r3")  # read, not yet taken up: joins it too
        assert isinstance(late, PendingHit) and late.done
        hits = [m.finish_read(p)[0] for p in (first, second, late)]
        assert reads.calls == 1
        for hit in hits:
            assert hit is not None
            assert [int(x) for x in hit.caches[0].keys[0, 0, : hit.kv_depth, 0].tolist()] == tokens
        st = m.stats()
        assert (st.disk_loads, st.promotions, st.hits, st.disk_hits) == (1, 1, 3, 3)
        assert entry.refs == 3
        for hit in hits:
            m.release(hit.entry_id)
        assert entry.refs == 0
    finally:
        m.close()


def test_one_row_gone_leaves_the_shared_read_to_the_others(tmp_path, monkeypatch):
    m, tokens, reads = _shared_read_setup(tmp_path, monkeypatch)
    try:
        first, second = _probe(m, tokens, "r1"), _probe(m, tokens, "r2")
        (entry,) = m.index.entries()
        m.cancel_read(first)
        assert entry.refs == 1 and not second.ticket.cancelled
        reads.gate.set()
        assert second.ticket.wait(5)
        hit, report = m.finish_read(second)
        assert hit is not None and report.tier == "disk" and reads.calls == 1
        m.release(hit.entry_id)
        assert entry.refs == 0
    finally:
        m.close()


def test_the_last_row_gone_drops_the_shared_read(tmp_path, monkeypatch):
    m, tokens, reads = _shared_read_setup(tmp_path, monkeypatch)
    try:
        first, second = _probe(m, tokens, "r1"), _probe(m, tokens, "r2")
        (entry,) = m.index.entries()
        m.cancel_read(second)
        m.cancel_read(first)
        assert entry.refs == 0 and first.ticket.cancelled
        reads.gate.set()
        assert first.ticket.wait(5)
        st = m.stats()
        assert (st.disk_loads, st.promotions) == (0, 0) and not entry.in_ram
        again = _probe(m, tokens, "r3")  # a fresh read, not the dropped one
        assert isinstance(again, PendingHit) and again.ticket is not first.ticket
        assert again.ticket.wait(5)
        hit, _ = m.finish_read(again)
        assert hit is not None
        m.release(hit.entry_id)
    finally:
        m.close()


@pytest.mark.parametrize("fail", ["transient", "damage"])
def test_a_shared_read_that_fails_misses_for_every_row_and_is_sorted_out_once(
    tmp_path, monkeypatch, fail
):
    import errno

    from kvcache.disk import CorruptFile

    exc = OSError(errno.EIO, "I/O error") if fail == "transient" else CorruptFile("bad CRC")
    m, tokens, reads = _shared_read_setup(tmp_path, monkeypatch, exc)
    files = _files(tmp_path)
    try:
        first, second = _probe(m, tokens, "r1"), _probe(m, tokens, "r2")
        (entry,) = m.index.entries()
        reads.gate.set()
        assert first.ticket.wait(5)
        assert m.finish_read(first)[0] is None and m.finish_read(second)[0] is None
        assert reads.calls == 1
        st = m.stats()
        assert (st.hits, st.misses) == (0, 2)
        m.flush()
        if fail == "transient":
            assert m.index.entries() == [entry] and entry.refs == 0
            assert _files(tmp_path) == files
            assert st.disk_files_discarded == 0
        else:
            assert m.index.entries() == [] and _files(tmp_path) == []
            assert st.disk_files_discarded == 1
    finally:
        m.close()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fd through /proc")
def test_new_blocks_names_are_durable_before_the_entry_naming_them(tmp_path, monkeypatch):
    """Blocks were renamed into blocks/xx/ folders (some just made) and only the
    entry's folder was synced: after a power loss the entry could survive while a
    block's name was lost. One sync per folder an entry's new blocks went into."""
    synced: list[Path] = []
    real = os.fsync

    def spy(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    m = manager(tmp_path)
    disk = m.disk

    def one_shard(digest):  # every block in one new shard: the syncs are batched
        return disk.dir / "blocks" / "ab" / f"{digest.hex()}.safetensors"

    monkeypatch.setattr(disk, "block_path", one_shard)
    monkeypatch.setattr(os, "fsync", spy)
    try:
        store(m, list(range(100, 200)), "S")  # 6 whole blocks of 16
        m.flush()
    finally:
        m.close()
    shard, blocks = (
        (tmp_path / NS / "blocks" / "ab").resolve(),
        (tmp_path / NS / "blocks").resolve(),
    )
    assert len(list(shard.glob("*.safetensors"))) == 6
    entry_dir = (tmp_path / NS / "entries").resolve()
    assert synced.count(shard) == 1 and synced.count(blocks) == 1
    entry_file = next(i for i, p in enumerate(synced) if p.parent == entry_dir)
    assert synced.index(shard) < entry_file and synced.index(blocks) < entry_file


@pytest.mark.parametrize("exc", [MemoryError(), RuntimeError("[metal::malloc] out of memory")])
def test_running_out_of_memory_assembling_a_saved_entry_keeps_it_and_its_files(
    tmp_path, monkeypatch, exc
):
    """Memory short for a moment while an entry in RAM was assembled counted as
    damage of its own arrays: the entry was discarded and, being on disk as a saved
    conversation, its files deleted with it."""
    a, b = _two_entries_sharing_a_prefix_one_saved(tmp_path)
    m = manager(tmp_path)
    try:
        assert served(m, b + [7]) == (b, "disk")  # read back: now in RAM too
        files = _files(tmp_path)

        def short(self, *args, **kw):
            raise exc

        monkeypatch.setattr(type(m.ops), "assemble", short)
        assert served(m, b + [7]) is None  # a miss this time...
        monkeypatch.undo()
        m.flush()
        assert _files(tmp_path) == files  # ...nothing deleted
        assert served(m, b + [7]) == (b, "ram")
        assert [c.conversation_id for c in m.saved_conversations()] == ["B"]
    finally:
        m.close()
