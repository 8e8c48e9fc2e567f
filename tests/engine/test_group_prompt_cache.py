"""The ranks of a group keep the same prompt cache: each measures entries by its own
shard's layers, yet every rank must hit, store and evict alike (engine.lockstep
stops the group at the first hit that disagrees)."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from engine import group_wire
from engine.boot_deadline import BootDeadline
from engine.group_boot import GroupBoot
from engine.lockstep import TickClock
from kvcache.index import PromptCacheConfig
from kvcache.layout import KVLayout, LayerKind, LayerKV, layout_multiples
from kvcache.manager import TieredKVManager
from kvcache.prompt_key import PromptKey
from scheduler.admission import MemoryBudget

H, D = 2, 32
ATTENTION = LayerKV(LayerKind.ATTENTION, 2 * H * D * 4)  # float32 keys + values
STATE = LayerKV(LayerKind.STATE, state_bytes=(3 * 256 + 4 * 32 * 32) * 4)
MIB = 2**20


def shard(attention: int, state: int) -> KVLayout:
    """A rank's slice of the model: its attention layers first, then its state layers."""
    types = ("KVCache",) * attention + ("ArraysCache",) * state
    return KVLayout((ATTENTION,) * attention + (STATE,) * state, types)


def budget(layout: KVLayout, prompt_cache: int) -> MemoryBudget:
    return MemoryBudget(
        8 * 2**30, 2**30, 2**28, layout.bytes_per_token, "test", prompt_cache, layout
    )


class Rank:
    """One rank's view of the group at start-up: every rank's budget comes back."""

    def __init__(self, rank: int, shares: list[MemoryBudget]):
        self.boot, self.rank, self.size = BootDeadline(), rank, len(shares)
        self.serving = rank == 0
        self._shares = shares

    def gather(self, data: bytes) -> list[bytes]:
        assert group_wire.loads(data) == self._shares[self.rank]  # this rank's own
        return [group_wire.dumps(s) for s in self._shares]


def sized(shards: list[KVLayout], caches: list[int]) -> list[tuple[MemoryBudget, int]]:
    shares = [budget(layout, cache) for layout, cache in zip(shards, caches)]
    return [
        GroupBoot(Rank(r, shares), "pipeline", 10.0, TickClock()).tightest(shares[r])  # type: ignore[arg-type]
        for r in range(len(shares))
    ]


def template(layout: KVLayout) -> list:
    return [KVCache() if la.kind is LayerKind.ATTENTION else ArraysCache(2) for la in layout.layers]


def filled(layout: KVLayout, length: int) -> list:
    out: list = []
    for la in layout.layers:
        if la.kind is LayerKind.ATTENTION:
            c = KVCache()
            c.update_and_fetch(mx.zeros((1, H, length, D)), mx.zeros((1, H, length, D)))
        else:
            c = ArraysCache(2)
            c[0], c[1] = mx.zeros((1, 3, 256)), mx.zeros((1, 4, 32, 32))
        out.append(c)
    return out


def test_layouts_are_multiples_of_one_mix_or_none():
    assert layout_multiples([shard(4, 0), shard(2, 0), shard(6, 0)]) == [4, 2, 6]
    assert layout_multiples([shard(2, 2), shard(1, 1)]) == [2, 1]
    assert layout_multiples([shard(0, 2), shard(0, 1)]) == [2, 1]
    assert layout_multiples([shard(3, 1), shard(1, 3)]) is None
    assert layout_multiples([shard(2, 0), shard(1, 1)]) is None  # trimmable on one rank only
    other = KVLayout((LayerKV(LayerKind.ATTENTION, 64),), ("KVCache",))
    assert layout_multiples([shard(1, 0), other]) is None  # other heads
    window = KVLayout((LayerKV(LayerKind.WINDOW, ATTENTION.bytes_per_token, window=512),))
    assert layout_multiples([shard(1, 0), window]) is None


@pytest.mark.parametrize(
    "shards, cache",
    [
        ([shard(2, 2), shard(1, 1)], MIB),  # a hybrid model's slices of one mix
        ([shard(0, 2), shard(0, 1)], 100_000),  # recurrent layers only: no bytes per token
        ([shard(3, 0), shard(2, 0)], MIB),
    ],
)
def test_ranks_of_one_mix_hold_the_same_entries_after_every_store(shards, cache):
    """Each rank's cache was its own bytes per token x one shared token count: a rank
    whose layers cost nothing per token (recurrent state) got as many bytes as
    tokens and evicted at other moments than the others."""
    sizes = [size for _, size in sized(shards, [cache, cache])]
    assert all(sizes)
    now = [0.0]
    managers = [
        TieredKVManager(
            PromptCacheConfig(max_entries=256), size, "ns", template(layout), clock=lambda: now[0]
        )
        for layout, size in zip(shards, sizes)
    ]
    evicted = False
    for i, length in enumerate([300, 500, 200, 700, 400, 350, 600, 250, 450, 300]):
        now[0] += 1.0
        key = PromptKey.build([1000 * (i + 1) + j for j in range(length)])
        held = []
        for layout, manager in zip(shards, managers):
            manager.store(key, filled(layout, length))
            held.append(sorted(e.entry_id for e in manager.index.entries() if e.in_ram))
        assert held[0] == held[1], f"store {i}: the ranks hold different entries {held}"
        evicted = evicted or len(held[0]) < i + 1
    assert evicted  # the caches were small enough to evict


def test_ranks_of_different_mixes_serve_without_a_prompt_cache(caplog):
    """Pipeline slices of a hybrid model (more recurrent layers on one rank) measure
    entries in ratios that change with their length: the caches evicted differently,
    and the group stopped at the first hit that disagreed. Off, said once, and the
    memory it would have held goes to the requests."""
    shards = [shard(3, 1), shard(1, 3)]
    with caplog.at_level(logging.WARNING, logger="kvwarm.distributed"):
        (serving, cache0), (worker, cache1) = sized(shards, [64 * MIB, 64 * MIB])
    assert cache0 == cache1 == 0
    assert serving.prompt_cache_bytes == worker.prompt_cache_bytes == 0
    assert serving.kv_budget_bytes == budget(shards[0], 0).kv_budget_bytes
    said = [r.getMessage() for r in caplog.records if "prompt cache is off" in r.getMessage()]
    assert len(said) == 2 and "rank 0: 3 attention, 1 state" in said[0]  # each rank says it
