"""Vision-language models through mlx-vlm, behind the text engine.

A VLM row runs in two parts. *Vision prefill* (engine thread, one row at a
time): the prompt up to the end of its last image goes through the language
model with the vision tower's features merged in at each image's tokens,
image by image, into an ordinary mlx-lm KV cache. The row then joins mlx-lm's
``BatchGenerator`` like a prefix-cache hit, with that cache and the text after
its last image, so rows with and without images prefill and decode together.

- ``VisionFront`` (worker threads) runs the model's processor: how many tokens
  an image becomes and its pixel inputs, as numpy, before the request is queued
  (admission counts those tokens).
- ``LanguageView`` is the language model as mlx-lm's generator and cache
  helpers expect a model: token ids in, logits out.
- ``VisionPrefill`` (engine thread) runs the tower, keeps each image's merged
  embeddings by its key (a re-sent image skips the tower), and fills caches.

Served: Idefics3 / SmolVLM, Gemma 3, LLaVA, Pixtral and Mistral 3 (image tokens at
sequential positions), and the
multimodal-RoPE Qwen2-VL and Qwen2.5-VL, whose images sit on a grid of
positions (engine.mrope: each row's position delta rides in its batch cache).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.model_errors import UnsupportedModelError
from engine.mrope import (
    PositionedKVCache,
    batch_positions,
    grid_shape,
    image_positions,
    position_span,
    sequential_positions,
)
from engine.vision_families import GRID_ROPE_FAMILIES, SERVED_FAMILIES
from kvcache.image_ids import (
    MAX_IMAGE_TOKENS,
    image_key,
    image_run,
    image_runs,
    real_tokens,
    run_digest,
    run_key,
)
from scheduler.contracts import ImageRejected
from scheduler.request import ImageInput

log = logging.getLogger("kvwarm.engine.vision")

# text around each image's token for families whose template writes it so
_IMAGE_TEXT = {f: ("<|vision_start|>", "<|vision_end|>") for f in GRID_ROPE_FAMILIES}
# the processor attribute naming the token it widens (default: image_token); Gemma 3
# widens its begin-of-image token into "\n\n<boi>" + soft tokens + "<eoi>\n\n"
_MARKER = {"gemma3": "boi_token"}
_NOT_INPUTS = {"input_ids", "attention_mask"}


def vision_config(model_dir: Path) -> dict[str, Any] | None:
    """The config of a vision-language model directory, or None (a text model)."""
    path = model_dir / "config.json"
    if not path.exists():
        return None
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return config if isinstance(config.get("vision_config"), dict) else None


def wants_vision(model_dir: Path, mode: str) -> bool:
    """--vision auto|on|off for this model directory."""
    if mode == "off":
        return False
    config = vision_config(model_dir)
    if config is None:
        if mode == "on":
            raise UnsupportedModelError(
                f"--vision on, but {model_dir} is not a vision model (no vision_config in "
                "config.json)"
            )
        return False
    family = str(config.get("model_type", ""))
    if family not in SERVED_FAMILIES:
        reason = (
            f"vision model type {family!r} is not served yet: kvwarm serves "
            f"{', '.join(sorted(SERVED_FAMILIES))}"
        )
        if mode == "on":
            raise UnsupportedModelError(reason)
        log.warning("%s; serving its text model only (--vision off to silence)", reason)
        return False
    return True


def family(vlm: Any) -> str:
    return str(getattr(vlm.config, "model_type", ""))


def grid_merge(vlm: Any) -> int | None:
    """Patches merged per side into one image token, for a multimodal-RoPE model."""
    if family(vlm) not in GRID_ROPE_FAMILIES:
        return None
    return int(vlm.config.vision_config.spatial_merge_size)


class LanguageView:
    """A VLM's language model as mlx-lm calls a model: ids (or embeddings) in, logits out."""

    def __init__(self, vlm: Any):
        self.vlm = vlm
        self.language_model = vlm.language_model
        self.grid_rope = grid_merge(vlm) is not None
        make_cache = getattr(self.language_model, "make_cache", None)
        if self.grid_rope:  # every row's cache carries its position delta (engine.mrope)
            self.make_cache = lambda: [PositionedKVCache() for _ in self.layers]
        elif make_cache is not None:  # mlx-vlm's own cache classes, as mlx-lm's
            self.make_cache = lambda: [mlx_lm_cache(c) for c in make_cache()]

    def __call__(
        self,
        inputs: Any,
        cache: Any = None,
        input_embeddings: Any = None,
        position_ids: Any = None,
        **_: Any,
    ):
        extra = {}
        if self.grid_rope:  # explicit positions: the model's own guess is per batch
            if position_ids is None:
                position_ids = batch_positions(cache[0] if cache else None, inputs.shape[1])
            extra["position_ids"] = position_ids
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache, **extra)
        return getattr(out, "logits", out)

    @property
    def layers(self) -> Any:
        return self.language_model.layers

    def parameters(self) -> Any:
        return self.vlm.parameters()

    def __getattr__(self, name: str) -> Any:  # args, model_type, ... of the language model
        return getattr(self.language_model, name)


def mlx_lm_cache(cache: Any) -> Any:
    """mlx-lm's class for one of mlx-vlm's cache objects: mlx-lm's BatchGenerator
    merges, filters and extracts only its own (both keep the same state)."""
    from mlx_lm.models import cache as lm

    kind = type(cache).__name__
    if kind == "KVCache":
        return lm.KVCache()
    if kind == "RotatingKVCache":
        return lm.RotatingKVCache(max_size=cache.max_size, keep=cache.keep)
    raise UnsupportedModelError(f"mlx-vlm's {kind} has no mlx-lm batch counterpart")


# Qwen2-VL's processors bound an image's area; transformers 5 keeps the bounds in
# its size dict, where these two keys hold pixel counts, not edges
_AREA_KEYS = {"max_pixels": "longest_edge", "min_pixels": "shortest_edge"}


def _area_sized(image_processor: Any) -> bool:
    return type(image_processor).__name__.startswith("Qwen2VL")


def pixel_bound(image_processor: Any, flag: str) -> int | None:
    """The processor's ``min_pixels`` or ``max_pixels``; None where it sizes by edge."""
    if hasattr(image_processor, flag):
        return getattr(image_processor, flag)
    if _area_sized(image_processor):
        return image_processor.size[_AREA_KEYS[flag]]
    return None


def set_pixel_bound(image_processor: Any, flag: str, value: int) -> bool:
    """Set it; False where the processor has no such bound."""
    if hasattr(image_processor, flag):
        setattr(image_processor, flag, value)
    elif _area_sized(image_processor):
        image_processor.size[_AREA_KEYS[flag]] = value
    else:
        return False
    return True


@dataclass(frozen=True)
class ImageExpansion:
    tokens: tuple[int, ...]  # the image's tokens as the model reads them
    inputs: dict[str, np.ndarray]  # the processor's pixel inputs for this image alone


class VisionFront:
    """The model's processor, for worker threads: placeholder text and expansions."""

    def __init__(
        self,
        processor: Any,
        tokenizer: Any,
        min_pixels: int | None,
        max_pixels: int | None,
        model_type: str = "",
        merge: int | None = None,
    ):
        self.processor = processor
        self.image_token = str(getattr(processor, _MARKER.get(model_type, "image_token")))
        before, after = _IMAGE_TEXT.get(model_type, ("", ""))
        self.placeholder = before + self.image_token + after
        self.markers = tuple(m for m in (before, self.image_token, after) if m)
        self.placeholder_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        self._merge = merge  # multimodal RoPE: the tokens span a grid of positions
        self._bos = getattr(tokenizer, "bos_token_id", None)
        image_processor = getattr(processor, "image_processor", None)
        for flag, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
            if value is None:
                continue
            if not set_pixel_bound(image_processor, flag, value):
                # Idefics3, Gemma 3, LLaVA, Pixtral size by edge, not by area
                log.warning(
                    "--%s is ignored: this model's image processor (%s) has no %s setting",
                    flag.replace("_", "-"),
                    type(image_processor).__name__,
                    flag,
                )
        self._lock = threading.Lock()  # processors keep state between calls

    @classmethod
    def for_model(
        cls,
        vlm: Any,
        processor: Any,
        tokenizer: Any,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> VisionFront:
        return cls(processor, tokenizer, min_pixels, max_pixels, family(vlm), merge=grid_merge(vlm))

    def expand(self, image: Any) -> ImageExpansion:
        try:
            with self._lock:
                out = self.processor(text=[self.image_token], images=[image])
        except (ValueError, ZeroDivisionError, IndexError) as exc:  # what they raise on shapes
            width, height = image.size
            raise ImageRejected(
                f"This model's image processor cannot read a {width}x{height} image: {exc}"
            ) from exc
        ids = [int(t) for t in np.asarray(out["input_ids"]).reshape(-1)]
        if ids and ids[0] == self._bos:
            ids = ids[1:]
        inputs = {k: np.asarray(v) for k, v in out.items() if k not in _NOT_INPUTS}
        return ImageExpansion(tuple(ids), inputs)

    def image_input(self, image: Any, digest: bytes, start: int) -> ImageInput:
        exp = self.expand(image)
        if len(exp.tokens) > MAX_IMAGE_TOKENS:  # what the cache key's ids can number
            width, height = image.size
            raise ImageRejected(
                f"A {width}x{height} image becomes {len(exp.tokens)} tokens, more than the "
                f"{MAX_IMAGE_TOKENS} one image may take: send it smaller or lower --max-pixels"
            )
        shift = 0
        if self._merge is not None:
            shift = position_span(grid_shape(exp.inputs, self._merge)) - len(exp.tokens)
        key = image_key(digest, exp.tokens)
        return ImageInput(
            start=start,
            tokens=exp.tokens,
            key=key,
            run_key=run_key(key, len(exp.tokens)),
            inputs=exp.inputs,
            rope_shift=shift,
        )


@dataclass
class VisionCounters:
    encoder_runs: int = 0
    encoder_seconds: float = 0.0
    feature_hits: int = 0  # images whose features were reused (the tower skipped)
    images_prefilled: int = 0


@dataclass
class VisionPrefill:
    """Engine thread: fills a row's cache through its images."""

    vlm: Any
    view: LanguageView
    feature_bytes: int = 256 * 2**20  # merged embeddings kept for re-sent images
    chunk: int = 512  # tokens per language-model call (the runner's prefill step size)
    counters: VisionCounters = field(default_factory=VisionCounters)
    # by the image's 32-byte keys (kvcache.image_ids), never by an id of its run:
    # a hash short enough to collide would hand one image another's
    _features: OrderedDict[bytes, Any] = field(default_factory=OrderedDict)  # by key
    _held: int = 0
    # owner (a row's request id) -> key of the image it is part-way through: kept
    # out of eviction until its last slice, within ``feature_bytes`` (release())
    _pins: dict[Any, bytes] = field(default_factory=dict)
    # by run_key: the image's tokens (maps cached keys back to model ids), its shift
    _expansions: OrderedDict[bytes, tuple[int, ...]] = field(default_factory=OrderedDict)
    _shifts: dict[bytes, int] = field(default_factory=dict)
    # run_digest of an image's ids in a cached key -> its run_key, and back
    _runs: dict[bytes, bytes] = field(default_factory=dict)
    _run_of: dict[bytes, bytes] = field(default_factory=dict)

    @property
    def merge(self) -> int | None:
        return grid_merge(self.vlm)

    def remember(self, images: Sequence[ImageInput]) -> None:
        """A row's images, before its lookup: a hit aligns only where they are, so
        every image a hit's tokens hold is known while the row needs it."""
        for image in images:
            key = image.run_key
            run = self._run_of.get(key)
            if run is None:
                run = run_digest(image_run(key, len(image.tokens)))
                self._expansions[key], self._run_of[key] = image.tokens, run
                if image.rope_shift:
                    self._shifts[key] = image.rope_shift
            else:
                self._expansions.move_to_end(key)
            self._runs[run] = key  # ids that are this row's image read as it
        while len(self._expansions) > 4096:
            old, _ = self._expansions.popitem(last=False)
            self._shifts.pop(old, None)
            run = self._run_of.pop(old)
            if self._runs.get(run) == old:
                del self._runs[run]

    def _image_of(self, run: Sequence[int]) -> bytes | None:
        """The run_key of the image whose identity ids are ``run``, every one of
        them compared (through run_digest); None: no image this server knows."""
        return self._runs.get(run_digest(run))

    def model_ids(self, tokens: Sequence[int]) -> list[int]:
        """A cached key's tokens as the model's ids (image identities expanded)."""
        return real_tokens(tokens, self._tokens_of)

    def _tokens_of(self, run: Sequence[int]) -> tuple[int, ...]:
        key = self._image_of(run)
        if key is None:
            raise KeyError("a cached key holds an image this server does not know")
        return self._expansions[key]

    def rope_delta(self, tokens: Sequence[int]) -> int:
        """The position delta after a cached key's tokens (engine.mrope): the sum
        of the shifts of the whole images in them."""
        if not self._shifts:
            return 0
        delta = 0
        for start, end in image_runs(tokens):
            key = self._image_of(tokens[start:end])
            if key is not None:
                delta += self._shifts.get(key, 0)
        return delta

    def run(
        self,
        prompt: Sequence[int],
        images: Sequence[ImageInput],
        start: int,
        cache: list,
        delta: int = 0,
        max_images: int | None = None,
        model: Any = None,
        tag: Any = None,
        max_tokens: int | None = None,
        resume: bool = False,
        owner: Any = None,
    ) -> tuple[int, int]:
        """Prefill ``prompt[start:]`` up to the end of its last image (or of its
        ``max_images``-th uncached one) into ``cache``, whose positions run ``delta``
        from its depth; returns the depth reached (``start`` when every image is
        already cached) and the delta there. ``model`` and ``tag``: the routed
        model and the row's adapter tag (engine.lora), so a LoRA row reads its
        images with its adapter, as it reads the rest of its prompt. ``max_tokens``:
        at most that many tokens, text and image alike (an engine step's prefill
        budget): the depth reached may then be inside the text or inside an image,
        where a later call ``resume``s (the tower runs once, whole: its features
        wait in the feature cache, pinned for ``owner`` until its last slice or
        ``release(owner)``; with no room to pin them, or no ``owner``, the image
        runs whole in this call rather than run its tower again each call)."""
        pos = start
        ran = 0
        room = max(1, max_tokens) if max_tokens is not None else len(prompt)
        for image in images:
            if image.end <= pos:
                continue  # its KV came from the prefix cache
            if max_images is not None and ran >= max_images:
                break
            ran += 1
            if image.start < pos and not resume:
                raise ValueError("a cached prefix ends inside an image")  # index retreats
            if image.start > pos:  # the text before it, within this call's room
                take = min(image.start - pos, room)
                self._feed_text(prompt[pos : pos + take], pos + delta, cache, model, tag)
                pos, room = pos + take, room - take
                if pos < image.start or room <= 0:
                    return pos, delta
            pos, room = self._feed_image(image, pos, room, delta, cache, model, tag, owner)
            if pos < image.end:
                return pos, delta  # the rest of it in a later call
            delta += image.rope_shift
            self.counters.images_prefilled += 1
            if room <= 0:
                break
        return pos, delta

    def _feed_text(self, ids: Sequence[int], first: int, cache: list, model: Any, tag: Any) -> None:
        """Text at positions from ``first`` (the language model's own for sequential ones)."""
        import mlx.core as mx

        positions = None if self.merge is None else sequential_positions(first, len(ids))
        self._feed(mx.array([list(ids)]), cache, None, positions, model, tag)

    def _feed_image(
        self,
        image: ImageInput,
        pos: int,
        room: int,
        delta: int,
        cache: list,
        model: Any,
        tag: Any,
        owner: Any = None,
    ) -> tuple[int, int]:
        """Up to ``room`` of the image's tokens from ``pos`` (inside it when
        resumed); returns the depth reached and the room left."""
        import mlx.core as mx

        into = pos - image.start
        left = len(image.tokens) - into
        features = self._embeddings(image, resumed=into > 0)
        take = min(left, room)
        kept = take == left or self._pin(owner, image.key)
        if not kept:  # its features would not stay until its next slice: all of it now
            take = left
        positions = None
        if self.merge is not None:
            grid = image_positions(grid_shape(image.inputs, self.merge), image.start + delta)
            positions = grid[..., into : into + take]
        embeds = features[:, into : into + take]
        ids = mx.array([list(image.tokens[into : into + take])])
        try:
            self._feed(ids, cache, embeds, positions, model, tag)
        finally:
            if take == left:  # the image is through (or failed): its pin goes
                self._pins.pop(owner, None)
            if not kept:
                self._trim(keep=None)  # held within the cap again, pins included
        return pos + take, room - take

    def _pin(self, owner: Any, key: bytes) -> bool:
        """Keep ``key``'s features for ``owner`` until its image ends: where they
        fit in the cache's cap beside the other rows' pinned ones (the cap is what
        VisionReserve holds back; the image in flight is its other part)."""
        if owner is None:
            return False
        others = {k for o, k in self._pins.items() if o != owner}
        need = sum(self._features[k].nbytes for k in others | {key})
        if key not in others and need > self.feature_bytes:
            return False
        self._pins[owner] = key
        return True

    def release(self, owner: Any) -> None:
        """``owner`` left mid-image (cancelled, failed): its features become an
        ordinary cache entry again, evicted in turn."""
        self._pins.pop(owner, None)

    def pinned(self) -> dict[Any, bytes]:
        """The rows part-way through an image, and its key."""
        return dict(self._pins)

    def held_features(self) -> int:
        """Bytes of merged embeddings the feature cache holds, pinned ones included."""
        return self._held

    def _trim(self, keep: bytes | None) -> None:
        """Evict the least recently used unpinned features, but ``keep``, down to the cap."""
        pinned = set(self._pins.values())
        for key in list(self._features):
            if self._held <= self.feature_bytes:
                break
            if key != keep and key not in pinned:
                self._held -= self._features.pop(key).nbytes

    def _feed(
        self, ids: Any, cache: list, embeds: Any, positions: Any, model: Any, tag: Any
    ) -> None:
        """Through the language model in chunks of ``chunk`` tokens: the attention
        transient stays what admission reserves for a text prefill step."""
        import mlx.core as mx

        forward = model if model is not None else self.view
        layers = cache if tag is None else [*cache, tag]
        n = ids.shape[1]
        for a in range(0, n, self.chunk):
            b = min(n, a + self.chunk)
            forward(
                ids[:, a:b],
                cache=layers,
                input_embeddings=embeds[:, a:b] if embeds is not None else None,
                position_ids=positions[..., a:b] if positions is not None else None,
            )
            mx.eval([c.state for c in cache])

    def _embeddings(self, image: ImageInput, resumed: bool = False) -> Any:
        """The image's merged embeddings; ``resumed``: for the rest of an image
        already begun (no feature hit: its tower ran for this row)."""
        import mlx.core as mx

        hit = self._features.get(image.key)
        if hit is not None:
            self._features.move_to_end(image.key)
            self.counters.feature_hits += not resumed
            return hit
        started = time.perf_counter()
        inputs = {k: mx.array(v) for k, v in image.inputs.items()}
        pixels = inputs.pop("pixel_values", None)
        ids = mx.array([list(image.tokens)])
        # every token is real (Gemma 3 builds its attention mask from this one)
        inputs.setdefault("mask", mx.ones(ids.shape, dtype=mx.int32))
        out = self.vlm.get_input_embeddings(ids, pixels, **inputs)
        embeds = out.inputs_embeds
        mx.eval(embeds)
        self.counters.encoder_runs += 1
        self.counters.encoder_seconds += time.perf_counter() - started
        self._features[image.key] = embeds
        self._held += embeds.nbytes
        self._trim(keep=image.key)  # pinned features stay: their rows read them next step
        return embeds


@dataclass(frozen=True)
class VisionReserve:
    """Memory a vision model needs beyond weights, KV and a text prefill step,
    held back from the KV budget at start: the feature cache's cap (rows part-way
    through an image keep its features within it), plus one image in flight (the
    engine encodes one at a time) sized for the largest image the processor
    makes: the tower's activations, its attention scores
    per attention block where the backend materialises them (the CPU's
    attention does; Metal's and CUDA's fused kernels do not), and the image's
    merged embeddings. The language model reads them in prefill-step chunks,
    within the text reserve."""

    features: int
    image: int
    image_tokens: int  # of the largest image
    patches: int  # the tower's input positions for it

    @property
    def total(self) -> int:
        return self.features + self.image


def vision_reserve(
    prefill: VisionPrefill, front: VisionFront, device: str, largest_side: int = 4096
) -> VisionReserve:
    """Sized by running the processor on a ``largest_side`` square (it scales
    down to its own maximum), so --max-pixels shrinks it."""
    from PIL import Image

    side = largest_side
    max_pixels = pixel_bound(getattr(front.processor, "image_processor", None), "max_pixels")
    if isinstance(max_pixels, int) and max_pixels > side * side:
        side = int(max_pixels**0.5) + 1
    exp = front.expand(Image.new("RGB", (side, side), (127, 127, 127)))
    tower = prefill.vlm.config.vision_config
    width = int(getattr(tower, "embed_dim", 0) or tower.hidden_size)
    heads = int(getattr(tower, "num_attention_heads", 0) or getattr(tower, "num_heads", 1))
    pixels = exp.inputs["pixel_values"]
    if pixels.ndim == 2:  # flattened patches (Qwen-VL): one attention block per image
        blocks, per_block = 1, pixels.shape[0]
    else:  # tiles (..., C, H, W), each attended to on its own
        patch = int(tower.patch_size)
        blocks = int(np.prod(pixels.shape[:-3]))
        per_block = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
    patches = blocks * per_block
    activations = patches * width * 4 * 8  # residual stream, MLP, q/k/v copies (float32)
    scores = blocks * heads * per_block * per_block * 4 if "cpu" in device.lower() else 0
    text_width = int(prefill.vlm.config.text_config.hidden_size)
    embeddings = len(exp.tokens) * text_width * 4
    return VisionReserve(
        features=prefill.feature_bytes,
        image=activations + scores + embeddings,
        image_tokens=len(exp.tokens),
        patches=patches,
    )


def load_vision(model_dir: Path) -> tuple[Any, Any]:
    """mlx-vlm's model and processor (engine thread)."""
    try:
        from mlx_vlm.utils import load
    except ImportError as exc:
        raise UnsupportedModelError(
            f"{model_dir} is a vision model and mlx-vlm is not installed "
            "(pip install 'kvwarm[vision]', or --vision off for its text model)"
        ) from exc
    try:
        return load(str(model_dir))
    except Exception as exc:  # noqa: BLE001 - any loader failure names the model
        raise UnsupportedModelError(f"mlx-vlm cannot load {model_dir}: {exc}") from exc
