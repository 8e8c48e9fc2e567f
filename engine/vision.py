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
  embeddings by identity (a re-sent image skips the tower), and fills caches.

Only families whose language model places image tokens at ordinary sequential
positions are served (Idefics3 / SmolVLM, LLaVA-style, Gemma 3); multimodal
RoPE families (Qwen2-VL and later) are refused at start with that reason.
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
from kvcache.image_ids import image_identity, real_tokens
from scheduler.request import ImageInput

log = logging.getLogger("kvwarm.engine.vision")

# families whose language model reads image tokens at plain sequential positions
SEQUENTIAL_FAMILIES = {"idefics3", "smolvlm", "llava", "gemma3", "mistral3", "pixtral"}
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
    if family not in SEQUENTIAL_FAMILIES:
        reason = (
            f"vision model type {family!r} is not served yet: kvwarm serves "
            f"{', '.join(sorted(SEQUENTIAL_FAMILIES))} (image tokens at sequential positions; "
            "multimodal-RoPE families such as Qwen2-VL need per-row position offsets)"
        )
        if mode == "on":
            raise UnsupportedModelError(reason)
        log.warning("%s; serving its text model only (--vision off to silence)", reason)
        return False
    return True


class LanguageView:
    """A VLM's language model as mlx-lm calls a model: ids (or embeddings) in, logits out."""

    def __init__(self, vlm: Any):
        self.vlm = vlm
        self.language_model = vlm.language_model
        make_cache = getattr(self.language_model, "make_cache", None)
        if make_cache is not None:
            self.make_cache = make_cache

    def __call__(self, inputs: Any, cache: Any = None, input_embeddings: Any = None, **_: Any):
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache)
        return getattr(out, "logits", out)

    @property
    def layers(self) -> Any:
        return self.language_model.layers

    def parameters(self) -> Any:
        return self.vlm.parameters()

    def __getattr__(self, name: str) -> Any:  # args, model_type, ... of the language model
        return getattr(self.language_model, name)


@dataclass(frozen=True)
class ImageExpansion:
    tokens: tuple[int, ...]  # the image's tokens as the model reads them
    inputs: dict[str, np.ndarray]  # the processor's pixel inputs for this image alone


class VisionFront:
    """The model's processor, for worker threads: placeholder text and expansions."""

    def __init__(
        self, processor: Any, tokenizer: Any, min_pixels: int | None, max_pixels: int | None
    ):
        self.processor = processor
        self.placeholder = str(processor.image_token)
        self.placeholder_id = int(tokenizer.convert_tokens_to_ids(self.placeholder))
        self._bos = getattr(tokenizer, "bos_token_id", None)
        image_processor = getattr(processor, "image_processor", None)
        if min_pixels is not None and hasattr(image_processor, "min_pixels"):
            image_processor.min_pixels = min_pixels
        if max_pixels is not None and hasattr(image_processor, "max_pixels"):
            image_processor.max_pixels = max_pixels
        self._lock = threading.Lock()  # processors keep state between calls

    def expand(self, image: Any) -> ImageExpansion:
        with self._lock:
            out = self.processor(text=[self.placeholder], images=[image])
        ids = [int(t) for t in np.asarray(out["input_ids"]).reshape(-1)]
        if ids and ids[0] == self._bos:
            ids = ids[1:]
        inputs = {k: np.asarray(v) for k, v in out.items() if k not in _NOT_INPUTS}
        return ImageExpansion(tuple(ids), inputs)

    def image_input(self, image: Any, digest: bytes, start: int) -> ImageInput:
        exp = self.expand(image)
        return ImageInput(
            start=start,
            tokens=exp.tokens,
            identity=image_identity(digest, exp.tokens),
            inputs=exp.inputs,
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
    counters: VisionCounters = field(default_factory=VisionCounters)
    _features: OrderedDict[int, Any] = field(default_factory=OrderedDict)
    _held: int = 0
    # image identity id -> the image's tokens: maps cached keys back to model ids
    _expansions: OrderedDict[int, tuple[int, ...]] = field(default_factory=OrderedDict)

    def remember(self, images: Sequence[ImageInput]) -> None:
        """A row's images, before its lookup: a hit aligns only where they are, so
        every identity a hit's tokens hold is known while the row needs it."""
        for image in images:
            self._expansions[image.identity] = image.tokens
            self._expansions.move_to_end(image.identity)
        while len(self._expansions) > 4096:
            self._expansions.popitem(last=False)

    def model_ids(self, tokens: Sequence[int]) -> list[int]:
        """A cached key's tokens as the model's ids (image identities expanded)."""
        return real_tokens(tokens, self._expansions)

    def run(
        self, prompt: Sequence[int], images: Sequence[ImageInput], start: int, cache: list
    ) -> int:
        """Prefill ``prompt[start:]`` up to the end of its last image into ``cache``;
        returns the depth reached (``start`` when every image is already cached)."""
        import mlx.core as mx

        pos = start
        for image in images:
            if image.end <= pos:
                continue  # its KV came from the prefix cache
            if image.start < pos:
                raise ValueError("a cached prefix ends inside an image")  # index retreats
            if image.start > pos:
                self.view(mx.array([list(prompt[pos : image.start])]), cache=cache)
            embeds = self._embeddings(image)
            self.view(mx.array([list(image.tokens)]), cache=cache, input_embeddings=embeds)
            mx.eval([c.state for c in cache])
            pos = image.end
            self.counters.images_prefilled += 1
        return pos

    def _embeddings(self, image: ImageInput) -> Any:
        import mlx.core as mx

        hit = self._features.get(image.identity)
        if hit is not None:
            self._features.move_to_end(image.identity)
            self.counters.feature_hits += 1
            return hit
        started = time.perf_counter()
        inputs = {k: mx.array(v) for k, v in image.inputs.items()}
        pixels = inputs.pop("pixel_values", None)
        out = self.vlm.get_input_embeddings(mx.array([list(image.tokens)]), pixels, **inputs)
        embeds = out.inputs_embeds
        mx.eval(embeds)
        self.counters.encoder_runs += 1
        self.counters.encoder_seconds += time.perf_counter() - started
        self._features[image.identity] = embeds
        self._held += embeds.nbytes
        while self._held > self.feature_bytes and len(self._features) > 1:
            _, old = self._features.popitem(last=False)
            self._held -= old.nbytes
        return embeds


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
