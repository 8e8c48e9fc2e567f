"""Multimodal RoPE (Qwen2-VL, Qwen2.5-VL) on mlx-lm's batch caches.

These models lay an image's ``t x h x w`` tokens on a 3-D grid of positions:
the image spans ``max(t, h, w)`` positions, not ``t*h*w``, so every token after
it sits at its index plus a (negative) per-row *delta*. Text has all three
position components equal, which is ordinary RoPE at ``index + delta``.

mlx-lm's ``BatchKVCache`` keeps a per-row ``offset`` that only RoPE reads
(masks read ``left_padding`` and ``_idx``), and rows keep their offsets as the
batch filters and extends. So a row's delta rides in that offset:
``PositionedKVCache.merge`` adds each row's delta as a batch is formed, and the
language model gets positions ``offset + i`` (``batch_positions``). A lone
``KVCache``'s offset is also its write index, so there the delta sits beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache


class PositionedKVCache(KVCache):
    """A row's KV cache whose RoPE positions run ``rope_delta`` from its length."""

    def __init__(self, rope_delta: int = 0):
        super().__init__()
        self.rope_delta = rope_delta

    @classmethod
    def holding(cls, cache: KVCache, rope_delta: int) -> PositionedKVCache:
        out = cls(rope_delta)
        out.keys, out.values, out.offset = cache.keys, cache.values, cache.offset
        return out

    def merge(self, caches: Sequence[KVCache]) -> BatchKVCache:
        batch = BatchKVCache.merge(caches)
        deltas = [getattr(c, "rope_delta", 0) for c in caches]
        if any(deltas):
            batch.offset = batch.offset + mx.array(deltas, dtype=batch.offset.dtype)
        return batch


def positioned(caches: Sequence[Any], rope_delta: int) -> list[Any]:
    """A row's caches carrying its delta into the batch it joins."""
    return [
        PositionedKVCache.holding(c, rope_delta) if isinstance(c, KVCache) else c for c in caches
    ]


def batch_positions(cache: Any, length: int) -> mx.array:
    """Positions (3, B, length) of the next ``length`` tokens of every row."""
    offset = cache.offset if cache is not None else 0
    if isinstance(offset, int):
        offset = mx.array([offset + getattr(cache, "rope_delta", 0)])
    pos = offset[:, None] + mx.arange(length)[None, :]
    return mx.broadcast_to(pos[None], (3, *pos.shape))


def sequential_positions(start: int, length: int) -> mx.array:
    """Positions (3, 1, length) of text tokens from ``start``."""
    pos = mx.arange(start, start + length)[None, None, :]
    return mx.broadcast_to(pos, (3, 1, length))


def grid_shape(inputs: dict[str, Any], merge: int) -> tuple[int, int, int]:
    """An image's token grid (t, h, w) from the processor's ``image_grid_thw``."""
    t, h, w = (int(v) for v in np.asarray(inputs["image_grid_thw"]).reshape(-1)[:3])
    return t, h // merge, w // merge


def image_positions(grid: tuple[int, int, int], base: int) -> mx.array:
    """Positions (3, 1, t*h*w) of an image's tokens whose first sits at ``base``."""
    t, h, w = grid
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    pos = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + base
    return mx.array(pos.astype(np.int32))[:, None, :]


def position_span(grid: tuple[int, int, int]) -> int:
    """How many positions an image's tokens take: the text after it starts there."""
    return max(grid)
