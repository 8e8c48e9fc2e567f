"""Load a model + tokenizer through mlx-lm (on the engine thread)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import make_prompt_cache

from engine.gguf_convert import convert_gguf
from engine.model_errors import UnsupportedModelError
from engine.model_source import ModelSource
from scheduler.admission import kv_bytes_per_token

log = logging.getLogger("kvwarm.engine.loader")

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    model_dir: Path
    model_id: str
    config: dict[str, Any]
    context_length: int
    weights_bytes: int
    kv_bytes_per_token: int
    num_heads: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)


def prefers_float32() -> bool:
    """Dequantised float32 is ~10x faster than 4-bit on the CPU backend (BLAS
    path); on Metal and CUDA the quantised kernels win."""
    return mx.default_device() == mx.cpu


def prepare_model_dir(source: ModelSource) -> Path:
    if source.kind == "gguf":
        return convert_gguf(source.path, dequantize=prefers_float32())
    return source.path


def _generation_defaults(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        log.warning("ignoring unreadable %s", path)
        return {}
    return {k: data[k] for k in _SAMPLING_FIELDS if data.get(k) is not None}


def _context_length(config: dict[str, Any], tokenizer) -> int:
    text_config = config.get("text_config", {})
    for key in ("max_position_embeddings", "max_seq_len", "seq_length", "n_positions"):
        for source in (config, text_config):
            if isinstance(source.get(key), int):
                return source[key]
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and limit < 10**7 else 4096


def _probe_kv(model) -> tuple[int, int]:
    """KV bytes per token and attention heads, read off a real one-token forward:
    the cache shapes and dtype are the truth, whatever the config calls them."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    per_token = 0
    heads = 0
    for layer in cache:
        keys = getattr(layer, "keys", None)
        if keys is None or not hasattr(keys, "shape"):
            raise UnsupportedModelError(
                f"{type(layer).__name__} caches are not supported yet (plain KV caches only)"
            )
        _, n_kv, _, head_dim = keys.shape
        per_token += kv_bytes_per_token(1, n_kv, head_dim, keys.dtype.size)
    args = getattr(model, "args", None)
    heads = int(getattr(args, "num_attention_heads", 0) or 0)
    return per_token, heads or 1


def load_model(source: ModelSource) -> LoadedModel:
    model_dir = prepare_model_dir(source)
    try:
        model, tokenizer, config = mlx_lm_load(str(model_dir), return_config=True)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise UnsupportedModelError(f"mlx-lm cannot load {model_dir}: {exc}") from exc
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    per_token, heads = _probe_kv(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_dir=model_dir,
        model_id=source.model_id,
        config=config,
        context_length=_context_length(config, tokenizer),
        weights_bytes=weights,
        kv_bytes_per_token=per_token,
        num_heads=heads,
        generation_defaults=_generation_defaults(model_dir),
    )
