"""Splitting a model over ranks: which split a model allows, and that the llama
pipeline wrapper computes what the model does (on a one-rank group, where no
activations travel)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from engine.model_errors import UnsupportedModelError
from engine.model_shards import (
    LlamaPipeline,
    pipeline_problem,
    shard_model,
    split_layers,
    tensor_problem,
)


@given(st.integers(1, 80), st.integers(1, 8))
def test_every_layer_runs_on_exactly_one_rank_last_layers_on_rank_0(layers, size):
    spans = [split_layers(layers, r, size) for r in range(size)]
    covered = sorted(i for start, end in spans for i in range(start, end))
    assert covered == list(range(layers))
    assert spans[0][1] == layers  # rank 0 ends the pipeline (it serves)
    counts = [end - start for start, end in spans]
    assert max(counts) - min(counts) <= 1


def test_head_counts_decide_tensor_parallelism(tiny_llama_dir):
    model, _ = load(str(tiny_llama_dir))  # 4 heads, 2 KV heads, 2 layers
    assert tensor_problem(model, 2) is None
    assert "do not divide by 3" in tensor_problem(model, 3)
    model.args.num_attention_heads = 9  # SmolLM2's: pipeline only
    model.args.num_key_value_heads = 3
    assert "9 attention / 3 KV heads" in tensor_problem(model, 2)
    assert pipeline_problem(model, 2) is None
    assert "2 layers cannot give each of 3 ranks" in pipeline_problem(model, 3)


def test_a_model_that_cannot_split_is_refused_naming_why(tiny_llama_dir):
    model, _ = load(str(tiny_llama_dir))
    group = mx.distributed.init()
    with pytest.raises(UnsupportedModelError, match="cannot be split that way"):
        model.args.num_attention_heads = 9
        shard_model(model, _Sized(group, 2), "tensor")

    class Opaque:
        pass

    with pytest.raises(UnsupportedModelError, match="tensor parallel: .* pipeline parallel"):
        shard_model(Opaque(), _Sized(group, 2), "auto")


class _Sized:
    """A group that says it has ``size`` ranks (only sizes are read before a split)."""

    def __init__(self, group, size: int):
        self._group, self._size = group, size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def test_llama_pipeline_on_one_rank_computes_what_the_model_does(tiny_llama_dir):
    model, _ = load(str(tiny_llama_dir))
    tokens = mx.array([[5, 9, 33, 71, 2, 8]])
    cache = make_prompt_cache(model)
    want = [model(tokens[:, :4], cache=cache), model(tokens[:, 4:], cache=cache)]
    group = mx.distributed.init()  # no launcher: a group of one
    assert shard_model(model, group, "pipeline") == "pipeline"
    assert isinstance(model.model, LlamaPipeline)
    cache = make_prompt_cache(model)
    got = [model(tokens[:, :4], cache=cache), model(tokens[:, 4:], cache=cache)]
    for w, g in zip(want, got):
        assert mx.allclose(w, g, atol=1e-5).item()
