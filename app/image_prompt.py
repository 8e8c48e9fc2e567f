"""Images in a chat prompt: from content parts to the tokens the model reads.

Runs in request preparation (a worker thread), in two halves around rendering:

1. ``resolve_images`` turns every message's parts into the string content the
   chat template renders. On a vision model each image becomes the model's
   placeholder token (and is decoded, within the limits); on a text model it
   is refused, or becomes a note naming its stable id (``--images
   placeholder``; images inside tool results always do, so an agent whose
   history holds a screenshot can go on).
2. ``attach_images`` widens each placeholder in the rendered key to the image's
   tokens (the processor decides how many) under its identity ids, and hands the
   engine each image's tokens and pixel inputs.

Images are numbered by content within a request (which holds the whole
conversation): a picture re-sent three times is "image 1" each time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from app.content_parts import IMAGE_OMITTED
from app.errors import APIError
from app.images import ImageLimits, ImageSource, LoadedImage, load_images
from engine.chat_template import REASONING_FIELDS
from engine.control_tokens import ControlTokens
from kvcache.image_ids import expand_images, image_run
from kvcache.prompt_key import PromptKey
from scheduler.contracts import ImageFront, ImageRejected
from scheduler.request import ImageInput


@dataclass
class ResolvedImages:
    """The request's images in prompt order (vision models) and their numbering."""

    images: list[LoadedImage] = field(default_factory=list)
    numbers: dict[bytes, int] = field(default_factory=dict)  # digest -> "image N"

    def number(self, image: LoadedImage) -> int:
        return self.numbers.setdefault(image.digest, len(self.numbers) + 1)


def _sources(messages: Sequence[dict[str, Any]]) -> list[tuple[int, ImageSource]]:
    """Each image's source and the index of the message holding it."""
    return [
        (index, part["source"])
        for index, m in enumerate(messages)
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image"
    ]


def resolve_images(
    messages: list[dict[str, Any]],
    front: ImageFront | None,
    limits: ImageLimits,
    placeholder_notes: bool,
    param: Callable[[int], str] = lambda i: f"messages.{i}.content",
) -> tuple[list[dict[str, Any]], ResolvedImages]:
    """Messages with string contents, and the images the model will read; ``param``
    names the client's field holding message ``i`` in errors."""
    if front is not None:  # with no image part all the same
        messages = _plain_markers(messages, front.markers)
    sources = _sources(messages)
    resolved = ResolvedImages()
    if not sources:
        return messages, resolved
    reading = front is not None or placeholder_notes
    loaded: list[list[LoadedImage]] = []  # per source: an image, or a video's frames
    if reading:  # a refused image names its message's field
        loaded = load_images([s for _, s in sources], limits, [param(i) for i, _ in sources])
    # else nothing is read: a user's image is refused below and a tool result's becomes
    # a note, so --max-images does not apply (an agent's history of screenshots goes on)
    out = []
    k = 0
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        pieces = []
        for part in content:
            if part.get("type") != "image":
                pieces.append(part.get("text", ""))
                continue
            if front is not None:
                for image in loaded[k]:
                    resolved.number(image)
                    resolved.images.append(image)
                    pieces.append(front.placeholder)
            elif placeholder_notes:
                pieces += [f"[image {resolved.number(i)}: {i.short_id}]" for i in loaded[k]]
            elif message.get("role") == "tool":
                pieces.append(IMAGE_OMITTED)
            else:
                raise APIError(
                    400,
                    "Image content is not supported by this model (a text model: serve a "
                    "vision model, or start with --images placeholder to replace images "
                    "with a note).",
                    param=param(index),
                )
            k += 1
        out.append({**message, "content": _join(pieces, front)})
    return out, resolved


def _join(pieces: list[str], front: ImageFront | None) -> str:
    """Text parts on their own lines; the image placeholder flush with its neighbours
    (the template decides the spacing around an image, as with parts)."""
    text = ""
    for i, piece in enumerate(pieces):
        if i and front is not None and front.placeholder in (piece, pieces[i - 1]):
            text += piece
        elif i:
            text += "\n" + piece
        else:
            text = piece
    return text


def _plain_markers(
    messages: list[dict[str, Any]], markers: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Message text holding the model's image markers keeps them as the characters
    they are, as other control tokens in client text (``engine.control_tokens``):
    refused (400), a tool result holding an RSS feed's ``<image>`` left the agent's
    conversation unservable from then on; kept as tokens, the model would read
    image tokens with no image behind them. Every role's: a reply the model wrote
    with those characters comes back as text too. Linear in the text."""
    plain = _marker_tokens(markers).text
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": plain(content)}
        elif isinstance(content, list):
            parts = [
                {**p, "text": plain(p["text"])}
                if isinstance(p, dict) and isinstance(p.get("text"), str)
                else p
                for p in content
            ]
            message = {**message, "content": parts}
        out.append(message)
    return out


def plain_replies(
    sent: Sequence[dict[str, Any]], healed: list[dict[str, Any]], front: ImageFront | None
) -> list[dict[str, Any]]:
    """The model's turns (``healed``, as healing gave them back from ``sent``) with
    the image markers made plain where ``_plain_markers`` does not reach: tool
    calls, reasoning fields, and the content healing put back (the reply as
    generated: its think block). None of those can hold an image; rendered as
    they were, a reply that wrote ``<image>`` (an RSS feed in a tool call) read as
    an image token with no image behind it, and the conversation was a 400 from
    then on. The same every turn: the rendered prefix stays the cached one."""
    if front is None:
        return healed
    control = _marker_tokens(front.markers)
    out = []
    for before, message in zip(sent, healed, strict=True):
        if message.get("role") == "assistant":
            swapped = message is not before  # healed: its content is as generated
            message = dict(message)
            if swapped and isinstance(message.get("content"), str):
                message["content"] = control.text(message["content"])
            for name in ("tool_calls", *REASONING_FIELDS):
                if message.get(name):
                    message[name] = control.plain(message[name])
        out.append(message)
    return out


@cache
def _marker_tokens(markers: tuple[str, ...]) -> ControlTokens:
    return ControlTokens(markers)


def attach_images(
    key: PromptKey, resolved: ResolvedImages, front: ImageFront
) -> tuple[PromptKey, list[int], tuple[ImageInput, ...]]:
    """The rendered key with each image widened to its tokens: the key (identity
    view), the model's prompt tokens, and the engine's image inputs."""
    at = [i for i, t in enumerate(key.model_tokens) if t == front.placeholder_id]
    if len(at) != len(resolved.images):
        # messages were made plain (``_plain_markers``, ``plain_replies``); the marker
        # can still come in through tool definitions, and the model would read image
        # tokens with no image behind them
        raise APIError(
            400,
            f"The rendered prompt holds {len(at)} image markers for "
            f"{len(resolved.images)} images: text outside the messages (tool "
            f"definitions) may not contain this model's image marker "
            f"{front.image_token!r}, and a chat template must render every message's "
            "content.",
        )
    if not resolved.images:
        return key, list(key.model_tokens), ()
    inputs: list[ImageInput] = []
    # a picture re-sent in the conversation is expanded once: the processor's time,
    # and its arrays held once (counted once against --max-image-inputs-bytes)
    expanded: dict[bytes, ImageInput] = {}
    shift = 0
    for number, (pos, image) in enumerate(zip(at, resolved.images), 1):
        item = expanded.get(image.digest)
        if item is not None:
            item = replace(item, start=pos + shift)
        else:
            try:
                item = front.image_input(image.image, image.digest, pos + shift)
            except ImageRejected as exc:
                raise APIError(400, f"Image {number} of the request: {exc}") from exc
            expanded[image.digest] = item
        inputs.append(item)
        shift += len(item.tokens) - 1
    wide = expand_images(
        key, [(p, image_run(i.run_key, len(i.tokens))) for p, i in zip(at, inputs)]
    )
    prompt = list(wide.model_tokens)
    if inputs[-1].end >= len(prompt):
        raise APIError(400, "A prompt cannot end with an image: nothing follows it to read it.")
    for item in inputs:
        prompt[item.start : item.end] = item.tokens
    return wide, prompt, tuple(inputs)
