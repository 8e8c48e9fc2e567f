"""A disk-tier hit reads only the blocks it reuses. A longer entry supersedes the
shorter ones, so after a restart a long conversation is often the only entry
holding a system prompt: each new conversation reusing its 512 tokens read (and
promoted into RAM) all 20k tokens of it. Model-free except the last test: each
position's KV holds the token it was computed for (tests.engine.test_kv_disk_faults)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvcache.disk_reads import PendingHit
from kvcache.index import PromptCacheConfig, VolatilePolicy
from kvcache.layout import KVQuant
from kvcache.manager import DiskConfig, Reuse, TieredKVManager
from kvcache.prompt_key import PromptKey
from scheduler.request import CacheHints
from tests.engine.test_kv_disk_faults import NS, GiB, caches_for, manager
from tests.engine.test_kv_store import (
    cold_output,
    disk_harness,
    llama,  # noqa: F401 - the fixture
)

BS = 16  # the faults manager's --kv-block-size
LENGTH = 20 * BS + 5  # 20 whole blocks and a 5-token private tail


class ReadSpy:
    """The disk tier's reads, counted: block files by digest, entry files by uid."""

    def __init__(self, m: TieredKVManager, monkeypatch: pytest.MonkeyPatch):
        assert m.disk is not None
        self.blocks: list[bytes] = []
        self.entries: list[str] = []
        read_block, read_entry = m.disk.read_block, m.disk.read_entry

        def block(digest, nbytes=None):
            self.blocks.append(digest)
            return read_block(digest, nbytes)

        def entry(uid, nbytes=None):
            self.entries.append(uid)
            return read_entry(uid, nbytes)

        monkeypatch.setattr(m.disk, "read_block", block)
        monkeypatch.setattr(m.disk, "read_entry", entry)


def on_disk_only(root: Path) -> list[int]:
    """One LENGTH-token entry stored, then the server restarted: it is on disk only."""
    tokens = list(range(1000, 1000 + LENGTH))
    first = manager(root)
    assert first.store(PromptKey.build(tokens), caches_for(tokens), session="s") is not None
    first.close()
    return tokens


def hit(m: TieredKVManager, prompt: list[int], defer: bool, rid: str = "r", **kw) -> Reuse:
    hints = CacheHints(PromptKey.build(prompt), "probe", **kw)
    reuse, _ = m.lookup(rid, hints, max_growth=0, defer_disk=defer)
    if isinstance(reuse, PendingHit):
        assert reuse.ticket.wait(5)
        reuse, _ = m.finish_read(reuse)
    assert isinstance(reuse, Reuse)
    return reuse


def ram(m: TieredKVManager) -> tuple[int, int, int]:
    st = m.stats().ram
    return st.bytes, st.blocks, st.entries


def assert_same_kv(got: list, want: list, depth: int) -> None:
    """``got`` holds exactly the first ``depth`` positions of ``want``."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.offset == depth and a.keys.shape[2] == depth
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert x.dtype == y.dtype
            assert mx.array_equal(x, y[..., :depth, :]).item()


@pytest.mark.parametrize("defer", [False, True])
def test_a_hit_on_a_short_prefix_reads_only_its_blocks_and_promotes_nothing(
    tmp_path, monkeypatch, defer
):
    tokens = on_disk_only(tmp_path)
    m = manager(tmp_path)
    try:
        (entry,) = m.index.entries()
        assert entry.on_disk and not entry.in_ram
        before = ram(m)
        spy = ReadSpy(m, monkeypatch)
        reuse = hit(m, tokens[:40] + [7, 8], defer)  # 40 positions: blocks 0, 1 and 2
        assert reuse.kv_depth == 40
        needed = entry.held.blocks[:3]
        assert spy.blocks == [d for d, _ in needed] and spy.entries == []
        st = m.stats()
        assert st.disk_load_bytes == sum(n for _, n in needed)
        assert st.disk_load_tokens == 3 * BS
        assert (st.disk_hits, st.disk_loads, st.promotions) == (1, 1, 0)
        assert not entry.in_ram and ram(m) == before  # RAM holds none of it
        assert entry.refs == 1
        m.release(reuse.entry_id)
        assert entry.refs == 0 and ram(m) == before and m._reads == {}
        # the row's KV is what a whole read of the entry gives
        whole = hit(m, tokens + [1], defer)
        assert_same_kv(reuse.caches, whole.caches, 40)
        m.release(whole.entry_id)
    finally:
        m.close()


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("depth", [LENGTH, 20 * BS, 20 * BS - 3])
def test_a_hit_reaching_the_last_block_reads_the_entry_whole_and_promotes_it(
    tmp_path, monkeypatch, defer, depth
):
    """Only the private tail (under one block) would be left out: it is read too,
    and the entry is back in RAM for the next hit."""
    tokens = on_disk_only(tmp_path)
    m = manager(tmp_path)
    try:
        (entry,) = m.index.entries()
        spy = ReadSpy(m, monkeypatch)
        reuse = hit(m, tokens[:depth] + [1], defer)
        assert reuse.kv_depth == depth
        assert spy.blocks == [d for d, _ in entry.held.blocks] and spy.entries == [entry.uid]
        st = m.stats()
        assert (st.disk_loads, st.promotions, st.disk_load_tokens) == (1, 1, LENGTH)
        assert entry.in_ram and ram(m) == (entry.held.total, 20, 1)
        assert_same_kv(reuse.caches, caches_for(tokens), depth)
        m.release(reuse.entry_id)
        assert entry.refs == 0 and entry.in_ram
    finally:
        m.close()


def test_rows_share_a_partial_read_only_as_deep_as_it_goes(tmp_path, monkeypatch):
    """A row needing more blocks than the read in flight reads its own (whole);
    a row needing fewer joins."""
    tokens = on_disk_only(tmp_path)
    m = manager(tmp_path)
    try:
        (entry,) = m.index.entries()
        spy = ReadSpy(m, monkeypatch)
        probes = {}
        for rid, depth in (("a", 40), ("b", 30), ("deep", LENGTH)):
            hints = CacheHints(PromptKey.build(tokens[:depth] + [1]), rid)
            probes[rid] = m.lookup(rid, hints, max_growth=0, defer_disk=True)[0]
        a, b, deep = probes["a"], probes["b"], probes["deep"]
        assert isinstance(a, PendingHit) and isinstance(b, PendingHit)
        assert isinstance(deep, PendingHit)
        assert b.read is a.read and deep.read is not a.read
        assert entry.refs == 3
        hits = {}
        for rid, pending in probes.items():
            assert pending.ticket.wait(5)
            reuse, _ = m.finish_read(pending)
            assert reuse is not None
            hits[rid] = reuse
        digests = [d for d, _ in entry.held.blocks]
        assert spy.blocks == digests[:3] + digests  # one read of 3 blocks, one whole
        assert spy.entries == [entry.uid]
        for rid, depth in (("a", 40), ("b", 30), ("deep", LENGTH)):
            assert_same_kv(hits[rid].caches, caches_for(tokens), depth)
            m.release(hits[rid].entry_id)
        st = m.stats()
        assert (st.disk_loads, st.promotions, st.disk_hits) == (2, 1, 3)
        assert entry.refs == 0 and entry.in_ram and m._reads == {}
    finally:
        m.close()


def _f16_caches(tokens: list[int]) -> list[KVCache]:
    """float16 KV of head dim 64 (what --kv-bits groups), position p holding tokens[p]."""
    out = []
    for layer in range(2):
        cache = KVCache()
        t = mx.array(tokens, dtype=mx.float16).reshape(1, 1, len(tokens), 1)
        k = mx.broadcast_to(t, (1, 2, len(tokens), 64)) + layer
        cache.update_and_fetch(k, k * 2)
        out.append(cache)
    return out


@pytest.mark.parametrize("defer", [False, True])
def test_a_partial_read_of_quantized_blocks_gives_what_a_whole_read_gives(
    tmp_path, monkeypatch, defer
):
    """A partial read never reads the private tail, whose dtype the assembled KV
    took: the quantized blocks' own (their scales') stands in for it."""

    def quantized_manager() -> TieredKVManager:
        config = PromptCacheConfig(block_size=16, kv_block_size=BS, policy=VolatilePolicy.STRICT)
        template = [KVCache() for _ in range(2)]
        return TieredKVManager(
            config, GiB, NS, template, DiskConfig(tmp_path, GiB), quant=KVQuant(8, 64)
        )

    tokens = list(range(100, 100 + LENGTH))
    first = quantized_manager()
    assert first.store(PromptKey.build(tokens), _f16_caches(tokens), session="s") is not None
    first.close()
    m = quantized_manager()
    try:
        spy = ReadSpy(m, monkeypatch)
        part = hit(m, tokens[:40] + [1], defer)
        assert len(spy.blocks) == 3 and spy.entries == []
        m.release(part.entry_id)
        whole = hit(m, tokens + [1], defer)
        assert m.stats().promotions == 1
        assert_same_kv(part.caches, whole.caches, 40)
        assert part.caches[0].keys.dtype == mx.float16
        m.release(whole.entry_id)
    finally:
        m.close()


def test_a_new_conversation_on_a_long_ones_system_prompt_equals_a_cold_run(
    llama,  # noqa: F811
    tmp_path,
):
    """On a real model: the row reusing a prefix of a disk-only entry's blocks
    decodes what a cache-less run does, from the blocks it read alone."""
    system = {"role": "system", "content": "You are a careful agent. " * 12}
    long_conv = [system, {"role": "user", "content": "tell me everything " * 20}]
    h = disk_harness(llama, tmp_path)
    h.run(h.request(long_conv))
    h.cache.close()
    again = disk_harness(llama, tmp_path)  # restarted: the entry is on disk only
    (entry,) = again.cache.index.entries()
    assert entry.on_disk and not entry.in_ram
    other = [system, {"role": "user", "content": "something else"}]
    ((out, cached),) = again.run(again.request(other, session="s2"))
    st = again.cache.stats()
    assert cached > 0 and st.disk_hits == 1 and st.promotions == 0
    assert st.disk_load_tokens < entry.length // 2
    assert out == cold_output(llama, other)
