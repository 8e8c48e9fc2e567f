"""Admission's per-row KV bound against the buffers mlx-lm's caches really allocate.

A cache rebuilt from stored KV (a prefix hit), merged into a batch, or grown by
a prefill chunk after a hit stands off the 256-position grid, and mlx-lm grows
it by whole steps from there: the layout's count must cover every such path,
or admission lets a batch outgrow the memory it was promised.
"""

from __future__ import annotations

import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import BatchKVCache, KVCache

from kvcache.layout import KVLayout, round_up

HEADS, DIM = 1, 4
ATTN = KVLayout.attention_only(1)  # one byte per position: bytes read as positions


def _kv(n: int, rows: int = 1) -> mx.array:
    return mx.zeros((rows, HEADS, n, DIM))


def _rebuilt(n: int) -> KVCache:
    """A cache as a prefix hit hands it over: exactly the reused positions."""
    cache = KVCache()
    cache.keys, cache.values, cache.offset = _kv(n), _kv(n), n
    return cache


def test_a_cache_grown_after_a_hit_holds_more_than_whole_steps():
    cache = _rebuilt(300)
    for _ in range(257):  # decode to 557 positions
        cache.update_and_fetch(_kv(1), _kv(1))
    assert cache.keys.shape[2] == 812 > round_up(557)  # the old bound said 768
    assert cache.keys.shape[2] <= ATTN.sequence_bytes(557)


def test_a_growth_from_the_grid_keeps_the_old_buffers_tail():
    """mlx-lm trims the buffer to its positions only off the 256 grid: grown from a
    position on it, the unused tail stays and a whole step more comes on top."""
    cache = _rebuilt(154)
    for n in (1, 1, 100, 300):
        cache.update_and_fetch(_kv(n), _kv(n))
    assert (cache.offset, cache.keys.shape[2]) == (556, 922)  # 366 past: over one step
    assert cache.keys.shape[2] <= ATTN.sequence_bytes(cache.offset)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 700),
    st.lists(
        st.sampled_from([1, 1, 1, 7, 100, 255, 256, 257, 300, 512, 1000, 2048]),
        min_size=1,
        max_size=16,
    ),
)
def test_a_row_never_allocates_past_its_count(reused, appends):
    cache = _rebuilt(reused) if reused else KVCache()
    for n in appends:
        cache.update_and_fetch(_kv(n), _kv(n))
        assert cache.keys.shape[2] <= ATTN.sequence_bytes(cache.offset)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 600), min_size=1, max_size=4), st.integers(1, 300))
def test_a_batch_never_allocates_past_its_widest_rows_count(lengths, decoded):
    batch = BatchKVCache.merge([_rebuilt(n) for n in lengths])
    for _ in range(decoded):
        batch.update_and_fetch(_kv(1, len(lengths)), _kv(1, len(lengths)))
    widest = max(lengths) + decoded
    assert batch.keys.shape[2] <= ATTN.sequence_bytes(widest)
