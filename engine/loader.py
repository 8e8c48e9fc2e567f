"""Load a model + tokenizer through mlx-lm (on the engine thread)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from engine import config_fields
from engine.file_digest import content_digest
from engine.gguf_convert import convert_gguf
from engine.model_errors import UnsupportedModelError
from engine.model_source import ModelSource
from kvcache.disk import FORMAT_VERSION
from kvcache.image_ids import IMAGE_KEY_SCHEME
from kvcache.layout import KVLayout, LayerKind, LayerKV
from kvcache.payloads import position_bytes

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
    layout: KVLayout
    num_heads: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    vision: Any = None  # engine.vision.VisionPrefill of a vision model; None: text only
    processor: Any = None  # its mlx-vlm processor


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
    stated = config_fields.context_length(config)  # fit reads it the same way
    if stated is not None:
        return stated
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and limit < 10**7 else 4096


def _layer_costs(cache: object) -> list[LayerKV]:
    # QuantizedKVCache subclasses nothing here; checked first so it is named, not mis-sized
    if isinstance(cache, QuantizedKVCache):
        raise UnsupportedModelError("quantized KV caches in the model itself are not supported")
    if isinstance(cache, RotatingKVCache):
        return [LayerKV(LayerKind.WINDOW, position_bytes(cache), window=cache.max_size)]
    if isinstance(cache, KVCache):
        return [LayerKV(LayerKind.ATTENTION, position_bytes(cache))]
    if isinstance(cache, ArraysCache):
        state = sum(a.nbytes for a in cache.cache if a is not None)
        return [LayerKV(LayerKind.STATE, state_bytes=state)]
    if isinstance(cache, CacheList):
        return [cost for part in cache.caches for cost in _layer_costs(part)]
    raise UnsupportedModelError(
        f"{type(cache).__name__} caches are not supported (KVCache, RotatingKVCache, "
        "ArraysCache and CacheList are)"
    )


def probe_layout(model: Any) -> KVLayout:
    """Each layer's cache cost, read off a real one-token forward: the cache
    types, shapes and dtypes are the truth, whatever the config calls them."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    layers = tuple(cost for layer in cache for cost in _layer_costs(layer))
    return KVLayout(layers, tuple(type(c).__name__ for c in cache))


def model_fingerprint(model_dir: Path) -> str:
    """Names the weights without reading them all: config + each weight file's
    name, size and first and last MiB. Stored KV of other weights is never read."""
    h = hashlib.blake2b(digest_size=8)
    config = model_dir / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(2**20))
            f.seek(max(0, size - 2**20))
            h.update(f.read(2**20))
    return h.hexdigest()


# besides config.json and the weights, what makes ranks of one group behave alike:
# stop tokens (mlx-lm reads eos_token_id from generation_config.json), the tokenizer
# (stop strings, text) and the chat template
GROUP_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    # tokenizers kept in other files (SentencePiece, byte-level BPE without a
    # tokenizer.json, tiktoken) and tokens added beside them
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tiktoken.model",
)
GROUP_SAMPLES = 64  # spread through each weight file, 64 KiB each


def group_fingerprint(model_dir: Path) -> str:
    """What the ranks of a distributed group compare at start: ``model_fingerprint``
    plus the files above and samples spread through every weight file (its first and
    last MiB alone named a fine-tune of the same shapes like its base)."""
    h = hashlib.blake2b(model_fingerprint(model_dir).encode(), digest_size=8)
    for name in GROUP_FILES:
        path = model_dir / name
        h.update(f"{name}:".encode() + (path.read_bytes() if path.exists() else b"-"))
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            for i in range(GROUP_SAMPLES):
                f.seek(size * i // GROUP_SAMPLES)
                h.update(f.read(2**16))
    return h.hexdigest()


def weights_digest(model_dir: Path, memo: Path) -> str:
    """The weights named by every byte (config + each weight file's SHA-256, each
    read once and remembered in ``memo``): what KV kept across restarts is keyed
    by. A fine-tune of the same shapes (a fused LoRA changes a few projections in
    some layers) differs from its base nowhere a sample is sure to look, and KV
    of its base would be read as its own."""
    h = hashlib.blake2b(digest_size=8)
    config = model_dir / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{path.name}:{content_digest(path, memo)}".encode())
    return h.hexdigest()


def kv_namespace(
    model_dir: Path, layout: KVLayout, memo: Path | None = None, images: bool = False
) -> str:
    """Where stored KV of this model belongs: weights, cache layout, file format,
    and for a model served with its images (``images``) how image tokens are
    keyed (kvcache.image_ids): keys of another scheme would read as other images,
    so its stored KV is never read back. With ``memo`` (KV that outlives the
    process: the SSD tier) the weights are named by their content, else by
    ``model_fingerprint``."""
    weights = weights_digest(model_dir, memo) if memo is not None else model_fingerprint(model_dir)
    scheme = f"-img{IMAGE_KEY_SCHEME}" if images else ""
    return f"{weights}-{layout.fingerprint()}-v{FORMAT_VERSION}{scheme}"


def _num_heads(model: Any, config: dict[str, Any]) -> int:
    args = getattr(model, "args", None)
    # a wrapper's (Gemma 3) text_config, with the defaults mlx-lm filled in
    text_args = getattr(args, "text_config", None)
    sources = (
        {key: getattr(args, key, None) for key in config_fields.HEADS},
        text_args,
        config,
        config.get("text_config"),  # a VLM's
    )
    for source in sources:  # under each name ModelArgs use (GPT-2's n_head, DBRX's n_heads)
        heads = (
            config_fields.first_int(source, config_fields.HEADS) if isinstance(source, dict) else 0
        )
        if heads:
            return heads
    return 1


def load_vision_model(source: ModelSource, model_dir: Path) -> LoadedModel:
    """A vision-language model: mlx-vlm's model and processor, mlx-lm's tokenizer;
    the engine's generator runs its language model (engine.vision)."""
    from mlx_lm.utils import load_tokenizer

    from engine.vision import LanguageView, VisionPrefill, load_vision

    vlm, processor = load_vision(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    view = LanguageView(vlm)  # its parameters are the tower's and the language model's
    return _loaded(source, model_dir, view, tokenizer, config, VisionPrefill(vlm, view), processor)


def load_model(
    source: ModelSource, shard: Callable[[Any], object] | None = None, vision: str = "off"
) -> LoadedModel:
    """Load with mlx-lm (mlx-vlm for a vision model, ``vision``: --vision);
    ``shard`` (distributed) splits the still-lazy model first, so a rank only
    ever reads its own part of the weights."""
    from engine.vision import wants_vision

    model_dir = prepare_model_dir(source)
    if shard is None and wants_vision(model_dir, vision):
        return load_vision_model(source, model_dir)
    try:
        model, tokenizer, config = mlx_lm_load(
            str(model_dir), return_config=True, lazy=shard is not None
        )
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise UnsupportedModelError(f"mlx-lm cannot load {model_dir}: {exc}") from exc
    if shard is not None:
        shard(model)
        mx.eval(model.parameters())
    return _loaded(source, model_dir, model, tokenizer, config)


def _loaded(
    source: ModelSource,
    model_dir: Path,
    model: Any,
    tokenizer: Any,
    config: dict[str, Any],
    vision: Any = None,
    processor: Any = None,
) -> LoadedModel:
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_dir=model_dir,
        model_id=source.model_id,
        config=config,
        context_length=_context_length(config, tokenizer),
        weights_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())),
        layout=probe_layout(model),
        num_heads=_num_heads(model, config),
        generation_defaults=_generation_defaults(model_dir),
        vision=vision,
        processor=processor,
    )
