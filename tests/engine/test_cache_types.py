"""Every cache type mlx-lm models use, on tiny random-weight instances of
mlx-lm's own model classes: load, admission sizing, batching with other rows,
prefix reuse, and greedy output exactly equal to a cache-less run."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from engine.loader import load_model
from engine.model_source import ModelSource
from kvcache.index import VolatilePolicy
from kvcache.layout import LayerKind
from kvcache.manager import DiskConfig
from scheduler.admission import MemoryBudget
from tests.engine.test_prefix_reuse import Harness, conversation, decode
from tests.helpers.tiny_models import ARCHITECTURES, TINY_WINDOW, write_tiny_arch

EXPECTED_KINDS = {
    "qwen3_next": {LayerKind.STATE, LayerKind.ATTENTION},
    "lfm2": {LayerKind.STATE, LayerKind.ATTENTION},
    "gemma3_text": {LayerKind.WINDOW, LayerKind.ATTENTION},
    "gpt_oss": {LayerKind.WINDOW, LayerKind.ATTENTION},
    "falcon_h1": {LayerKind.STATE, LayerKind.ATTENTION},  # CacheList(ArraysCache, KVCache)
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_dir(request, tmp_path_factory):
    return request.param, write_tiny_arch(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def arch_model(arch_dir):
    _, path = arch_dir
    return load(str(path))


def test_loads_with_a_layout_that_counts_each_cache_type(arch_dir):
    arch, path = arch_dir
    loaded = load_model(ModelSource(path=path, kind="mlx", model_id=arch))
    layout = loaded.layout
    assert {layer.kind for layer in layout.layers} == EXPECTED_KINDS[arch]
    assert not layout.trimmable  # windows and states cannot be cut back to any depth
    for layer in layout.layers:
        if layer.kind is LayerKind.WINDOW:
            assert layer.window == TINY_WINDOW and layer.bytes_per_token > 0
        if layer.kind is LayerKind.STATE:
            assert layer.state_bytes > 0 and layer.bytes_per_token == 0
    # a window stops growing, a state never grows, attention grows per position
    far, near = layout.sequence_bytes(8192), layout.sequence_bytes(256)
    assert far - near == layout.attention_bytes_per_token * (8192 - 256)
    budget = MemoryBudget(
        total_bytes=far * 2 + 10,
        weights_bytes=0,
        reserve_bytes=0,
        kv_bytes_per_token=layout.bytes_per_token,
        layout=layout,
    )
    assert 8192 <= budget.ceiling_tokens < 8192 * 3


def _turns(h):
    ((first, _),) = h.run(h.request(conversation(turns=1)))
    return conversation(turns=1) + [
        {"role": "assistant", "content": decode(h, first)},
        {"role": "user", "content": "and then?"},
    ]


def test_reuse_and_batching_give_exactly_the_cacheless_output(arch_dir, arch_model):
    h = Harness(arch_model, VolatilePolicy.STRICT)
    assert not h.runner._trimmable
    turn2 = _turns(h)
    other = conversation(turns=3)  # another agent's longer prompt, decoding alongside
    other[0]["content"] = "A different agent. " + other[0]["content"]
    (warm, cached), (beside, _) = h.run(h.request(turn2), h.request(other, session="s2"))
    # the system prompt + first question were checkpointed at the message boundary
    assert cached >= len(h.request(conversation(turns=1)).prompt_tokens) - 8
    assert h.cache.stats().hits >= 1
    cold = Harness(arch_model, VolatilePolicy.STRICT, cache=False)
    ((alone, _),) = cold.run(cold.request(turn2))
    ((other_alone, _),) = cold.run(cold.request(other))
    assert warm == alone
    assert beside == other_alone


def _state(cache, entry) -> list[np.ndarray]:
    caches = cache._caches(entry, entry.length)
    flat = [v for c in caches for _, v in tree_flatten(c.state)]
    return [np.array(v) for v in flat if isinstance(v, mx.array)]


def test_kv_survives_a_restart_for_every_cache_type(arch_dir, arch_model, tmp_path):
    """Sliding windows, recurrent states and CacheLists go to disk and come back
    (their state through files), and the warm turn still equals a cold run."""
    h = Harness(arch_model, VolatilePolicy.STRICT, disk=DiskConfig(tmp_path, 2**30))
    turn2 = _turns(h)
    h.cache.close()
    stored = {e.key.model_tokens: _state(h.cache, e) for e in h.cache.index.entries()}
    again = Harness(arch_model, VolatilePolicy.STRICT, disk=DiskConfig(tmp_path, 2**30))
    assert again.cache.stats().restored_entries == len(stored)
    for e in again.cache.index.entries():  # every array of every layer, bit for bit
        loaded = _state(again.cache, e)
        want = stored[e.key.model_tokens]
        assert len(loaded) == len(want) and all(np.array_equal(a, b) for a, b in zip(loaded, want))
    again.cache.close()  # a restart: the folder is one server's at a time
    again = Harness(arch_model, VolatilePolicy.STRICT, disk=DiskConfig(tmp_path, 2**30))
    ((warm, cached),) = again.run(again.request(turn2))
    st = again.cache.stats()
    assert st.disk_hits == 1 and cached > 0
    cold = Harness(arch_model, VolatilePolicy.STRICT, cache=False)
    ((alone, _),) = cold.run(cold.request(turn2))
    assert warm == alone
