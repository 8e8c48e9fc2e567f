"""Splitting a loaded (still lazy) model over a group: tensor or pipeline parallel.

Tensor parallelism is the model class's own ``shard`` (mlx-lm). Pipeline
parallelism is the class's own ``pipeline`` (mlx-lm's PipelineMixin: qwen2,
deepseek, glm...) or, for llama-style models that lack it (SmolLM2, Llama),
``LlamaPipeline`` below, which splits the same way mlx-lm does: rank 0 runs the
last layers, the last rank the first, activations pass rank to rank with
send/recv and the final hidden state is all-gathered so every rank computes the
same logits and samples the same token.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from engine.model_errors import UnsupportedModelError


def _heads(model: Any) -> tuple[int, int]:
    args = getattr(model, "args", None)
    heads = int(getattr(args, "num_attention_heads", 0) or 0)
    kv = int(getattr(args, "num_key_value_heads", 0) or heads)
    return heads, kv


def tensor_problem(model: Any, size: int) -> str | None:
    """Why ``model`` cannot be tensor-parallel over ``size`` ranks (None: it can)."""
    if not hasattr(model, "shard"):
        return f"{type(model).__module__} has no tensor-parallel shard()"
    heads, kv = _heads(model)
    if heads and (heads % size or kv % size):
        return f"its {heads} attention / {kv} KV heads do not divide by {size} ranks"
    return None


def pipeline_problem(model: Any, size: int) -> str | None:
    inner = getattr(model, "model", None)
    if inner is None or not (hasattr(inner, "pipeline") or _llama_like(model)):
        return f"{type(model).__module__} has no pipeline split"
    layers = len(getattr(inner, "layers", []))
    if layers < size:
        return f"its {layers} layers cannot give each of {size} ranks one"
    return None


def _llama_like(model: Any) -> bool:
    inner = getattr(model, "model", None)
    return getattr(
        model, "model_type", getattr(getattr(model, "args", None), "model_type", "")
    ) in ("llama", "mistral") and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm"))


def shard_model(model: Any, group: Any, mode: str) -> str:
    """Shard ``model`` in place over ``group``; returns the mode used.

    ``auto`` takes tensor parallelism where the model allows it (every rank
    works on every token) and pipeline otherwise. A model that supports neither
    is refused, naming why."""
    size = group.size()
    tensor, pipeline = tensor_problem(model, size), pipeline_problem(model, size)
    if mode == "auto":
        mode = "tensor" if tensor is None else "pipeline" if pipeline is None else ""
    if mode == "tensor" and tensor is None:
        model.shard(group)
        return "tensor"
    if mode == "pipeline" and pipeline is None:
        inner = model.model
        if hasattr(inner, "pipeline"):
            inner.pipeline(group)
        else:
            model.model = LlamaPipeline(inner, group)
        return "pipeline"
    reasons = {"tensor": tensor, "pipeline": pipeline}
    if mode in reasons:
        raise UnsupportedModelError(
            f"--distributed-mode {mode}: the model cannot be split that way: {reasons[mode]}"
        )
    raise UnsupportedModelError(
        f"the model cannot be split over {size} ranks: tensor parallel: {tensor}; "
        f"pipeline parallel: {pipeline}"
    )


def split_layers(n_layers: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the layers ``rank`` runs: mlx-lm's even split, low ranks
    taking the extra layers, rank 0 the last ones."""
    base, extra = divmod(n_layers, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(counts[rank + 1 :])
    return start, start + counts[rank]


class LlamaPipeline(nn.Module):
    """A llama-style decoder running only this rank's slice of its layers."""

    def __init__(self, inner: Any, group: Any):
        super().__init__()
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        start, end = split_layers(len(inner.layers), self.rank, self.size)
        self.start_idx, self.end_idx = start, end
        self.embed_tokens = inner.embed_tokens
        self.norm = inner.norm
        self.layers = inner.layers[start:end]  # the others are never materialised
        self.sliding_window = getattr(inner, "sliding_window", None)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None):
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        masks: dict[bool, Any] = {}
        for layer, c in zip(self.layers, cache):
            sliding = bool(getattr(layer, "use_sliding", False))
            if sliding not in masks:
                window = self.sliding_window if sliding else None
                masks[sliding] = create_attention_mask(h, c, window_size=window)
        if self.rank < self.size - 1:  # the rank after us in the pipeline runs first
            h = mx.distributed.recv_like(h, self.rank + 1, group=self.group)
        for layer, c in zip(self.layers, cache):
            h = layer(h, masks[bool(getattr(layer, "use_sliding", False))], cache=c)
        if self.rank != 0:
            h = mx.distributed.send(h, self.rank - 1, group=self.group)
            if cache[-1] is not None:  # keep the send in the graph the step evaluates
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        h = mx.distributed.all_gather(h, group=self.group)[: h.shape[0]]
        return self.norm(h)
