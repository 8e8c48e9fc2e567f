"""The KV store on real (tiny, random-weight) models: shared blocks, the SSD tier,
restarts, and files that must never be used (torn, corrupt, foreign).

Greedy output is a function of the KV the model reads, so every warm turn is
checked against a cache-less run of the same prompt."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from mlx_lm import load

from engine.loader import kv_namespace, probe_layout
from kvcache.disk import FORMAT_VERSION
from kvcache.index import VolatilePolicy
from kvcache.layout import KVQuant
from kvcache.manager import DiskConfig
from kvcache.safetensors_io import CorruptFile, read_verified
from tests.engine.test_prefix_reuse import Harness, conversation, decode
from tests.helpers.tiny_models import write_tiny_llama

STRICT = VolatilePolicy.STRICT
GiB = 2**30


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load(str(tiny_llama_dir))


def disk_harness(model, root: Path, ram: int | None = None, disk_bytes: int = GiB, **kw):
    h = Harness(model, STRICT, disk=DiskConfig(root, disk_bytes), kv_block=16, **kw)
    if ram is not None:
        h.cache.index.max_bytes = ram
    return h


def second_turn(h, first_reply):
    return conversation(turns=1) + [
        {"role": "assistant", "content": decode(h, first_reply)},
        {"role": "user", "content": "and then?"},
    ]


def cold_output(model, messages):
    cold = Harness(model, STRICT, cache=False)
    ((out, _),) = cold.run(cold.request(messages))
    return out


def distinct_tokens(token_lists) -> int:
    """Positions in the trie of these token sequences (shared prefixes once)."""
    seen: set[int] = set()
    for tokens in token_lists:
        h = 0
        for t in tokens:
            h = hash((h, t))
            seen.add(h)
    return len(seen)


def test_agents_sharing_a_system_prompt_hold_it_once(llama):
    h = Harness(llama, STRICT, kv_block=16)
    conversations = []
    for i in range(8):
        msgs = conversation(turns=1)
        msgs[1]["content"] = f"agent {i} has its own task number {i * 7919}"
        conversations.append(msgs)
    agents = [h.request(m, session=f"agent-{i}") for i, m in enumerate(conversations)]
    results = h.run(*agents)
    st = h.cache.stats()
    entries = h.cache.index.entries()
    assert len(entries) >= 8
    logical = st.ram.bytes + st.ram.shared_saved_bytes  # what full copies would hold
    per_token = logical / sum(e.length for e in entries)
    distinct = distinct_tokens(e.key.model_tokens for e in entries)
    assert st.ram.bytes <= 1.2 * distinct * per_token
    assert st.ram.shared_saved_bytes > 3 * st.ram.bytes  # the system prompt, held once
    for msgs, (out, _) in zip(conversations, results):  # sharing changed no output
        assert out == cold_output(llama, msgs)


def test_restart_finds_the_kv_on_disk_and_the_warm_turn_equals_a_cold_one(llama, tmp_path):
    h = disk_harness(llama, tmp_path)
    ((first, _),) = h.run(h.request(conversation(turns=1)))
    h.cache.close()  # a clean shutdown flushes the writer
    assert h.cache.stats().disk.entries >= 1
    turn2 = second_turn(h, first)

    again = disk_harness(llama, tmp_path)  # a new process: nothing in RAM
    st = again.cache.stats()
    assert st.restored_entries >= 1 and st.ram.entries == 0
    ((warm, cached),) = again.run(again.request(turn2))
    st = again.cache.stats()
    assert cached > len(again.request(conversation(turns=1)).prompt_tokens)
    assert st.disk_hits == 1 and st.disk_load_tokens > 0 and st.promotions == 1
    assert warm == cold_output(llama, turn2)


def test_an_entry_evicted_from_ram_is_served_from_disk(llama, tmp_path):
    h = disk_harness(llama, tmp_path)
    ((first, _),) = h.run(h.request(conversation(turns=1)))
    h.cache.flush()
    h.cache.index.max_bytes = h.cache.index.nbytes + 1  # room for about one conversation
    other = conversation(turns=1)
    other[0]["content"] = "Someone else entirely. " + other[0]["content"]
    h.run(h.request(other, session="s2"))
    h.cache.flush()
    st = h.cache.stats()
    assert st.demotions >= 1 and st.evictions == 0
    turn2 = second_turn(h, first)
    ((warm, cached),) = h.run(h.request(turn2))
    assert h.cache.stats().disk_hits == 1 and cached > 0
    assert warm == cold_output(llama, turn2)


def _kv_files(root: Path, namespace: str = "tiny") -> tuple[list[Path], list[Path]]:
    ns = root / namespace
    return sorted(ns.glob("blocks/*/*.safetensors")), sorted(ns.glob("entries/*.safetensors"))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_block_is_discarded_never_loaded(llama, tmp_path, damage):
    h = disk_harness(llama, tmp_path)
    ((first, _),) = h.run(h.request(conversation(turns=1)))
    h.cache.close()
    blocks, _ = _kv_files(tmp_path)
    for path in blocks:  # damage every block: whatever the hit reads is bad
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-5] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            path.write_bytes(bytes(data[: len(data) // 2]))
    again = disk_harness(llama, tmp_path)
    turn2 = second_turn(h, first)
    ((warm, cached),) = again.run(again.request(turn2))
    st = again.cache.stats()
    assert st.disk_files_discarded >= 1 and st.disk_load_tokens == 0
    assert warm == cold_output(llama, turn2)  # recomputed, not read from a bad file


def test_torn_writes_and_foreign_files_are_deleted_at_start(llama, tmp_path):
    h = disk_harness(llama, tmp_path)
    h.run(h.request(conversation(turns=1)))
    h.cache.close()
    blocks, entries = _kv_files(tmp_path)
    torn = entries[0].with_name(f".{entries[0].name}.tmp-123")
    torn.write_bytes(entries[0].read_bytes()[:100])  # a write cut by kill -9
    orphan = blocks[0].with_name("00" * 16 + ".safetensors")
    orphan.write_bytes(blocks[0].read_bytes())  # a block no manifest names
    os.remove(blocks[-1])  # an entry whose block is gone
    again = disk_harness(llama, tmp_path)
    st = again.cache.stats()
    assert st.disk_files_discarded >= 3
    assert not torn.exists() and not orphan.exists()
    assert st.restored_entries < len(entries)  # the entry that lost a block


def test_another_model_never_reads_these_files(tmp_path, llama, tiny_llama_dir):
    other_dir = write_tiny_llama(tmp_path / "other", seed=4)  # same shapes, other weights
    other = load(str(other_dir))
    ns_a = kv_namespace(tiny_llama_dir, probe_layout(llama[0]))
    ns_b = kv_namespace(other_dir, probe_layout(other[0]))
    assert ns_a != ns_b and ns_a.endswith(f"-v{FORMAT_VERSION}")
    h = disk_harness(llama, tmp_path / "kv", namespace=ns_a)
    h.run(h.request(conversation(turns=1)))
    h.cache.close()
    b = disk_harness(other, tmp_path / "kv", namespace=ns_b)
    assert b.cache.stats().restored_entries == 0
    b.cache.close()
    # files moved into the other model's folder are refused, never loaded
    blocks, entries = _kv_files(tmp_path / "kv", ns_a)
    theirs = tmp_path / "kv" / ns_b
    shutil.copy(entries[0], theirs / "entries" / entries[0].name)
    with pytest.raises(CorruptFile, match="another model"):
        read_verified(blocks[0], ns_b)
    b = disk_harness(other, tmp_path / "kv", namespace=ns_b)
    st = b.cache.stats()
    assert st.restored_entries == 0 and st.disk_files_discarded == 1
    ((out, _),) = b.run(b.request(conversation(turns=1)))
    assert out == cold_output(other, conversation(turns=1))


def test_an_unusable_kv_dir_leaves_the_cache_in_ram(llama, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the KV folder should be")
    h = disk_harness(llama, blocker / "kv")
    ((out, _),) = h.run(h.request(conversation(turns=1)))
    st = h.cache.stats()
    assert not st.disk_enabled and st.ram.entries >= 1
    assert out == cold_output(llama, conversation(turns=1))


def test_a_failing_disk_turns_the_tier_off_and_no_request_fails(llama, tmp_path, monkeypatch):
    import errno

    import kvcache.disk as disk_module

    def broken(*_a, **_k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_module, "write_atomic", broken)
    h = disk_harness(llama, tmp_path)
    ((first, _),) = h.run(h.request(conversation(turns=1)))
    h.cache.flush()
    st = h.cache.stats()
    assert "Input/output error" in (st.disk_degraded or "") and st.disk_write_errors == 1
    assert st.disk.entries == 0 and st.ram.entries >= 1  # kept in RAM, nothing on disk
    turn2 = second_turn(h, first)
    ((warm, cached),) = h.run(h.request(turn2))
    assert cached > 0 and warm == cold_output(llama, turn2)


def test_a_full_disk_skips_writes_keeps_no_partial_file_and_the_tier_on(
    llama, tmp_path, monkeypatch
):
    """ENOSPC turned the tier off until a restart and left the partial temp file
    holding space on the full disk; it now skips the write, as the 90% guard
    does, and writes again once there is room."""
    import errno

    import kvcache.safetensors_io as io_module

    real_fsync = io_module.os.fsync

    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io_module.os, "fsync", full)
    h = disk_harness(llama, tmp_path)
    ((first, _),) = h.run(h.request(conversation(turns=1)))
    h.cache.flush()
    st = h.cache.stats()
    assert st.disk_degraded is None and st.disk_writes_skipped >= 1 and st.disk.entries == 0
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    monkeypatch.setattr(io_module.os, "fsync", real_fsync)
    h.cache.disk._occupancy_at = 0.0  # the guard samples the disk again: there is room
    h.run(h.request(second_turn(h, first)))
    h.cache.flush()
    assert h.cache.stats().disk.entries >= 1


def test_writes_stop_at_the_disk_occupancy_guard(llama, tmp_path):
    h = disk_harness(llama, tmp_path)
    h.cache.disk.max_occupancy = 0.0  # as if the file system were past 90% full
    h.run(h.request(conversation(turns=1)))
    h.cache.flush()
    st = h.cache.stats()
    assert st.disk_writes_skipped >= 1 and st.disk_files_written == 0


@pytest.fixture(scope="module")
def llama_hd64(tmp_path_factory):
    """Head dim 64: what mx.quantize's groups of 32/64 divide."""
    return load(str(write_tiny_llama(tmp_path_factory.mktemp("llama-hd64"), seed=5, hidden=256)))


@pytest.mark.parametrize("bits,tolerance", [(8, 0.02), (4, 0.2)])
def test_quantized_blocks_are_smaller_close_and_survive_a_restart(
    llama_hd64, tmp_path, bits, tolerance
):
    quant = KVQuant(bits, 64)
    full = Harness(llama_hd64, STRICT, kv_block=16)
    small = disk_harness(llama_hd64, tmp_path, quant=quant)
    msgs = conversation(turns=1)
    full.run(full.request(msgs))
    small.run(small.request(msgs))
    (f,) = [e for e in full.cache.index.entries() if e.length > 100]
    (q,) = [e for e in small.cache.index.entries() if e.length > 100]
    assert f.key.model_tokens == q.key.model_tokens
    # bytes per cached token: packed values + a scale and a bias per group
    ratio = q.nbytes / f.nbytes
    expected = (64 * bits / 8 + 8) / (64 * 4)  # float32 KV
    assert ratio == pytest.approx(expected, rel=0.15)
    exact, approx = _kv(full.cache, f), _kv(small.cache, q)
    for a, b in zip(exact, approx):
        assert np.max(np.abs(a - b)) <= tolerance * np.max(np.abs(a))
    small.cache.close()
    again = disk_harness(llama_hd64, tmp_path, quant=quant)
    (r,) = [e for e in again.cache.index.entries() if e.length > 100]
    for a, b in zip(approx, _kv(again.cache, r)):  # the files hold the quantized blocks
        assert np.array_equal(a, b)


def test_a_requests_kv_bits_keeps_its_own_precision(llama_hd64):
    """KV stored at 8 bits is reused only by requests asking for 8 bits; the
    full-precision entry of the same prompt is kept beside it."""
    h = Harness(llama_hd64, STRICT, kv_block=16)
    msgs = conversation(turns=1)
    ((_, cached),) = h.run(h.request(msgs, kv_bits=8))
    assert cached == 0
    ((_, cached),) = h.run(h.request(msgs))  # full precision: the 8-bit entry is not offered
    assert cached == 0
    ((_, cached),) = h.run(h.request(msgs, kv_bits=8))
    assert cached == len(h.request(msgs).prompt_tokens) - 1
    variants = {e.variant: e.nbytes for e in h.cache.index.entries() if e.length > 100}
    assert set(variants) == {"", "q8g64s0"} and variants["q8g64s0"] < variants[""] / 3


def _kv(cache, entry):
    caches = cache._caches(entry, entry.length)
    return [np.array(x) for c in caches for x in (c.keys, c.values)]


def test_kv_files_are_plain_safetensors(llama, tmp_path):
    """Inspectable with the usual tools: mx.load reads a block file as written."""
    import mlx.core as mx

    h = disk_harness(llama, tmp_path)
    h.run(h.request(conversation(turns=1)))
    h.cache.close()
    blocks, entries = _kv_files(tmp_path)
    arrays, meta = mx.load(str(blocks[0]), return_metadata=True)
    assert set(arrays) == {"k0", "v0", "k1", "v1"} and meta["namespace"] == "tiny"
    mine, _, _ = read_verified(blocks[0], "tiny")
    assert all(np.array_equal(np.array(arrays[n]), mine[n]) for n in arrays)
    assert "manifest" in mx.load(str(entries[0]), return_metadata=True)[1]


def test_a_tier_kind_registered_in_one_place_is_used(llama, tmp_path, monkeypatch):
    from kvcache import tiers
    from kvcache.disk import DiskTier

    written: list[str] = []

    class Recording(DiskTier):
        def submit(self, job):
            written.append(job.uid)
            super().submit(job)

    monkeypatch.setitem(tiers.PERSISTENT_TIERS, "recording", Recording)
    h = Harness(llama, STRICT, disk=DiskConfig(tmp_path, GiB, kind="recording"))
    h.run(h.request(conversation(turns=1)))
    h.cache.close()
    assert written and {e.uid for e in h.cache.index.entries() if e.on_disk} <= set(written)


def test_the_write_queue_comes_out_of_the_ram_cap(llama, tmp_path):
    """Queued writes hold their KV until written, even after the entry leaves RAM:
    RAM entries plus the queue stay within the cache's bytes."""
    h = Harness(llama, STRICT, disk=DiskConfig(tmp_path, GiB))  # a 64 MiB cache
    assert h.cache.disk.max_pending_bytes == 16 * 2**20
    assert h.cache.index.max_bytes == 48 * 2**20
    h.cache.close()


def test_a_new_turn_writes_only_its_new_blocks(llama, tmp_path):
    """The turn's entry supersedes the last one; the blocks they share stay on disk
    (no delete-and-rewrite of the whole conversation every turn)."""
    h = disk_harness(llama, tmp_path)
    first_req = h.request(conversation(turns=1))
    ((first, _),) = h.run(first_req)
    h.cache.flush()
    before = h.cache.stats().disk_bytes_written
    second = h.request(second_turn(h, first))
    h.run(second)
    h.cache.flush()
    st = h.cache.stats()
    written = st.disk_bytes_written - before
    new_tokens = len(second.prompt_tokens) - len(first_req.prompt_tokens)
    assert st.disk.entries == 1 and st.superseded >= 1  # the old turn is gone, its blocks kept
    assert written <= (new_tokens + 12 + 2 * 16) * st.disk.bytes_per_token + 64 * 1024
    assert written < st.disk.bytes / 2


def test_freed_memory_is_trimmed_at_most_once_an_interval(monkeypatch):
    """The C heap is trimmed after evictions, but not on every one (a trim walks
    the allocator's arenas)."""
    from kvcache import os_memory

    calls: list[int] = []
    clock = iter([0.0, 0.5, 1.9, 2.1, 2.2, 5.0])
    monkeypatch.setattr(os_memory.time, "monotonic", lambda: next(clock))
    give_back = os_memory.MemoryReturner(min_interval_s=2.0)
    give_back._trim = calls.append
    for _ in range(6):
        give_back()
    assert calls == [0, 0, 0] and give_back.trims == 3  # at 0.0, 2.1 and 5.0


def test_saving_behind_a_busy_write_queue_says_so_and_works_once_it_drains(llama, tmp_path):
    """A save the queue cannot take now names the queue, not --kv-disk-bytes."""
    from kvcache.interface import StorageFull

    h = disk_harness(llama, tmp_path)
    disk = h.cache.disk
    disk._pending_bytes = disk.max_pending_bytes  # as if the writer had fallen behind
    try:
        h.run(h.request(conversation(turns=1), session="busy"))
        with pytest.raises(StorageFull, match="write queue is full"):
            h.cache.save_conversation("busy", None)
    finally:
        disk._pending_bytes = 0
    assert h.cache.save_conversation("busy", None)
    h.cache.close()


def test_an_entry_larger_than_the_write_queue_is_written_once_the_queue_is_empty(tmp_path):
    """The queue's cap is back-pressure, not a size limit: a lone large entry waits
    for an empty queue instead of never reaching the disk."""
    from kvcache.disk import DiskTier

    tier = DiskTier(tmp_path, "ns", max_pending_bytes=100)
    try:
        assert tier.room_for(500)  # nothing queued: written alone
        tier._pending_bytes = 10  # a write in flight
        assert not tier.room_for(500) and tier.room_for(90) and not tier.room_for(91)
    finally:
        tier._pending_bytes = 0
        tier.close()
