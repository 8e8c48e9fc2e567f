"""Images in the prefix cache's key: another image never hits, the same one does,
and a hit never ends inside an image."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.image_prompt import ResolvedImages, attach_images
from app.images import LoadedImage
from engine import vision
from engine.vision import VisionFront, VisionPrefill
from kvcache.image_ids import (
    IMAGE_ID_BASE,
    MAX_IMAGE_TOKENS,
    MIN_RUN_TOKENS,
    expand_images,
    image_key,
    image_position,
    image_run,
    image_runs,
    image_start,
    image_tokens,
    is_image_id,
    real_tokens,
    run_digest,
)
from kvcache.index import PrefixIndex
from kvcache.prompt_key import PromptKey, TokenSpan
from kvcache.volatile_rules import RULE_INDEX
from scheduler.request import ImageInput
from tests.helpers.colliding_images import collide

PLACEHOLDER = 7  # what the model reads at every image position
BLOCK = 4


STEM = [90, 91, 92, 93, 94, 95, 96, 97]  # a system prompt: two full blocks


def prompt(text_before, image: bytes | None, span: int, text_after) -> PromptKey:
    """Model tokens with one image of ``span`` tokens, in the key's identity view."""
    tokens = STEM + list(text_before)
    if image is not None:
        tokens += image_tokens(image, [PLACEHOLDER] * span)
    return PromptKey.build(tokens + list(text_after))


texts = st.lists(st.integers(100, 104), min_size=0, max_size=12)
images = st.binary(min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(texts, images, images, st.integers(1, 9), texts, texts)
def test_the_same_text_with_another_image_never_reuses_past_the_image(
    before, first, second, span, after, tail
):
    index = PrefixIndex(max_bytes=10**6, block_size=BLOCK, namespace="m")
    stored = prompt(before, first, span, after + [1, 2])
    index.insert(stored, len(stored.model_tokens), True)
    asked = prompt(before, second, span, after + [1, 2] + tail + [3])
    hit = index.lookup(asked).hit
    reused = hit.reused if hit else 0
    if first != second:
        assert reused <= len(STEM) + len(before)  # nothing of the image nor what follows it
    else:
        # the same image re-sent hits as far as an ideal cache could
        assert reused == len(stored.model_tokens)


@settings(max_examples=200, deadline=None)
@given(texts, images, st.integers(2, 9), st.data())
def test_a_hit_that_would_end_inside_an_image_retreats_to_its_start(before, image, span, data):
    index = PrefixIndex(max_bytes=10**6, block_size=BLOCK, namespace="m")
    full = prompt(before, image, span, [1, 2, 3])
    start = len(STEM) + len(before)
    cut = data.draw(st.integers(start + 1, start + span - 1))
    index.insert(full.truncated(cut), cut, True)  # an entry ending mid-image
    hit = index.lookup(full).hit
    assert hit is not None and hit.reused == len(STEM) + len(before)
    assert index.counters.vlm_retreat == 1


def test_retreat_is_counted_and_clean_traffic_counts_none():
    index = PrefixIndex(max_bytes=10**6, block_size=BLOCK, namespace="m")
    full = prompt([100, 101, 102, 103, 104], b"cat", 6, [1, 2, 3])
    index.insert(full, len(full.model_tokens), True)
    hit = index.lookup(prompt([100, 101, 102, 103, 104], b"cat", 6, [1, 2, 3, 4])).hit
    assert hit.reused == len(full.model_tokens) and index.counters.vlm_retreat == 0
    # another turn that ends where the image ends reuses it whole, nothing to cut
    hit = index.lookup(prompt([100, 101, 102, 103, 104], b"cat", 6, [9, 9])).hit
    assert hit.reused == len(STEM) + 5 + 6 and index.counters.vlm_retreat == 0


def test_identity_ids_are_never_vocabulary_ids_and_depend_on_the_split():
    a = image_tokens(b"x", [PLACEHOLDER] * 3)
    assert all(is_image_id(t) for t in a) and not is_image_id(0) and not is_image_id(-1)
    assert all(-(2**63) <= t <= IMAGE_ID_BASE for t in a)  # int64: block hashes pack 'q'
    assert [image_position(t) for t in a] == [0, 1, 2]
    assert len(set(a)) == 3  # each token its own hash
    # another --max-pixels: other tokens for the same pixels, even at the same count
    assert a != image_tokens(b"x", [PLACEHOLDER] * 4)[:3]
    assert image_tokens(b"x", [7, 8, 7]) != image_tokens(b"x", [7, 7, 8])
    assert a == image_tokens(b"x", [PLACEHOLDER] * 3)  # and the same image, the same ids
    tokens = [1, *a, 2]
    assert [image_start(tokens, d) for d in range(6)] == [0, 1, 1, 1, 4, 5]
    with pytest.raises(ValueError):
        image_run(image_key(b"x", [PLACEHOLDER]), MAX_IMAGE_TOKENS + 1)


def _reminder_with_image(image: bytes, note: int, rule_name: str = "inbound_context") -> PromptKey:
    """STEM, then a volatile block of the user's (dropped from the cache key)
    holding ``note`` and a screenshot, then the question."""
    span = 6
    rule = RULE_INDEX[rule_name]
    tokens = STEM + [100, note, PLACEHOLDER, 101] + [102, 103, 104]
    at = len(STEM) + 2
    key = PromptKey.build(tokens, [TokenSpan(len(STEM), len(STEM) + 4, rule)])
    return expand_images(key, [(at, image_tokens(image, [PLACEHOLDER] * span))])


def test_an_image_inside_a_volatile_block_is_compared_not_stepped_over():
    """Under --volatile-policy reuse a changed volatile block is stepped over as a
    stale value: an image inside one was too, and another screenshot reused the
    first one's KV whole (the model answered about the first)."""
    index = PrefixIndex(max_bytes=10**6, block_size=BLOCK, namespace="m")
    stored = _reminder_with_image(b"red", note=110)
    index.insert(stored, len(stored.model_tokens), True)
    image_at = len(STEM) + 2
    other = index.lookup(_reminder_with_image(b"blue", note=110).extended([1])).hit
    assert (other.reused if other else 0) <= image_at
    # the same image beside a changed note still reuses past both (a stale note)
    same = index.lookup(_reminder_with_image(b"red", note=111).extended([1])).hit
    assert same is not None and same.reused == len(stored.model_tokens)
    # but a changed reminder is read, not stepped over, image and all
    reminder = _reminder_with_image(b"red", note=110, rule_name="system_reminder")
    index.insert(reminder, len(reminder.model_tokens), True)
    changed = _reminder_with_image(b"red", note=111, rule_name="system_reminder")
    hit = index.lookup(changed.extended([1])).hit
    assert (hit.reused if hit else 0) <= len(STEM)


# -- the same key's tokens through the server's own path: the model's processor
# (VisionFront, here a stand-in), then attach_images


class _Processor:
    image_token = "<image>"

    def __init__(self, span: int):
        self.span = span

    def __call__(self, text, images):
        return {"input_ids": np.array([[PLACEHOLDER] * self.span]), "pixel_values": np.zeros(1)}


class _Tokenizer:
    bos_token_id = None

    def convert_tokens_to_ids(self, token: str) -> int:
        return PLACEHOLDER


def served_with_images(
    digests: list[bytes], span: int, after: list[int]
) -> tuple[PromptKey, tuple[ImageInput, ...]]:
    """STEM, the images one after another, then ``after``, keyed as the server
    keys a request, and the images as the engine gets them."""
    front = VisionFront(_Processor(span), _Tokenizer(), None, None)
    key = PromptKey.build(STEM + [PLACEHOLDER] * len(digests) + after)
    images = ResolvedImages([LoadedImage(None, d) for d in digests])
    wide, prompt, inputs = attach_images(key, images, front)
    assert prompt[len(STEM) : len(STEM) + span] == [PLACEHOLDER] * span
    return wide, inputs


def served(digests: list[bytes], span: int, after: list[int]) -> PromptKey:
    return served_with_images(digests, span, after)[0]


def engine_knowing(*inputs: ImageInput) -> VisionPrefill:
    """The engine's map from a cached key's image ids to the model's (no model needed)."""
    prefill = VisionPrefill(vlm=None, view=None)
    prefill.remember(inputs)
    return prefill


SPAN = 6


@pytest.mark.parametrize("keep", range(SPAN))
def test_a_hit_through_an_image_needs_every_one_of_its_tokens_to_agree(monkeypatch, keep):
    """Two images whose short hashes collide (the scheme before gave an image one
    48-bit id, and a birthday search found two images with one id in 2^24 tries:
    the second got a full hit on the first one's KV). Here the two images' runs
    agree at every token but ``keep``: the hit still stops at the image's start."""
    collide(monkeypatch, keep)
    first = served([b"first image"], SPAN, [100, 101, 102, 103, 1])
    second = served([b"second image"], SPAN, [100, 101, 102, 103, 1, 2])
    image = slice(len(STEM), len(STEM) + SPAN)
    index = PrefixIndex(max_bytes=10**6, block_size=BLOCK, namespace="m")
    index.insert(first, len(first.model_tokens), True)
    hit = index.lookup(second).hit
    assert hit is not None and hit.reused == len(STEM)  # the text before, never the image
    assert index.counters.vlm_retreat == (keep > 0)  # a match up to ``keep``, cut back
    # the collision as simulated: the two images' ids differ at ``keep`` alone
    differ = [a != b for a, b in zip(first.model_tokens[image], second.model_tokens[image])]
    assert differ == [k == keep for k in range(SPAN)]
    # the same image again hits whole, collisions or not
    again = served([b"first image"], SPAN, [100, 101, 102, 103, 1, 2])
    hit = index.lookup(again).hit
    assert hit is not None and hit.reused == len(first.model_tokens)


def test_adjacent_images_are_runs_of_their_own():
    """The same image twice in a row, then another, with nothing between: each
    its own run, and a hit may end between two of them, not inside one."""
    key = served([b"cat", b"cat", b"dog"], SPAN, [1, 2]).model_tokens
    a, b, c = (len(STEM) + i * SPAN for i in range(3))
    runs = [tuple(run[-2:]) for run in image_runs(key)]
    assert runs == [(a, b), (b, c), (c, c + SPAN)]
    assert key[a:b] == key[b:c] != key[c : c + SPAN]
    for depth in range(len(key) + 1):
        inside = [s for s in (a, b, c) if s <= depth < s + SPAN]
        assert image_start(key, depth) == (inside[0] if inside else depth)
    # each run maps back to its own image's tokens, by all of its ids
    tokens_of = {run_digest(key[a:b]): (11,) * SPAN, run_digest(key[c : c + SPAN]): (12,) * SPAN}

    def expansion(run):
        return tokens_of[run_digest(run)]

    assert real_tokens(key, expansion) == [*STEM, *[11] * (2 * SPAN), *[12] * SPAN, 1, 2]
    with pytest.raises(KeyError):  # part of an image is no image
        real_tokens(key[: c + SPAN - 1], expansion)


def test_the_engine_maps_each_image_back_by_all_of_its_ids(monkeypatch):
    """Two images whose runs differ at one token only: the engine's map from a
    cached key to the model's ids (and to multimodal-RoPE shifts) tells them apart."""
    collide(monkeypatch, keep=SPAN - 1)
    cat_key, (cat,) = served_with_images([b"cat"], SPAN, [1])
    dog_key, (dog,) = served_with_images([b"dog"], SPAN, [1])
    cat = replace(cat, tokens=(21,) * SPAN, rope_shift=-2)
    dog = replace(dog, tokens=(22,) * SPAN, rope_shift=-3)
    engine = engine_knowing(cat, dog)
    assert engine.model_ids(cat_key.model_tokens) == [*STEM, *[21] * SPAN, 1]
    assert engine.model_ids(dog_key.model_tokens) == [*STEM, *[22] * SPAN, 1]
    assert engine.rope_delta(cat_key.model_tokens) == -2
    assert engine.rope_delta(dog_key.model_tokens) == -3
    with pytest.raises(KeyError):  # part of an image is no image
        engine.model_ids(cat_key.model_tokens[: len(STEM) + SPAN - 1])
    with pytest.raises(KeyError):  # nor is one it was never told of
        engine.model_ids(served([b"eel"], SPAN, [1]).model_tokens)


def test_ids_of_an_older_format_are_never_an_image_nor_a_place_outside_the_prompt():
    """A key restored from an older format (one id over a whole image), or any id
    whose position claims an image starting before the prompt: image_start stays
    within the prompt and before ``depth``, and no run of them maps to an image."""
    old = IMAGE_ID_BASE - 0x5EED_0000_0007  # the scheme before: one id for a whole image
    tokens = [5, old, old, old, old, 6]
    assert [tuple(run[-2:]) for run in image_runs(tokens)] == [(i, i + 1) for i in range(1, 5)]
    assert [image_start(tokens, d) for d in range(7)] == [0, 1, 1, 1, 1, 5, 6]
    _, (image,) = served_with_images([b"cat"], 4, [1])
    with pytest.raises(KeyError):  # no image has these ids
        engine_knowing(image).model_ids(tokens)
    # positions that count up from before the prompt's start, or skip one
    early = [IMAGE_ID_BASE - ((9 << 20) | k) for k in (5, 6, 7)]
    assert [image_start([*early, 1], d) for d in range(5)] == [0, 0, 0, 3, 4]
    skip = [IMAGE_ID_BASE - ((9 << 20) | k) for k in (0, 1, 3, 4)]
    assert [image_start([2, *skip], d) for d in range(6)] == [0, 1, 1, 1, 1, 5]
    assert [tuple(run[-2:]) for run in image_runs([2, *skip])] == [(1, 3), (3, 5)]
    assert all(is_image_id(t) for t in [old, *early, *skip])


def test_an_image_of_too_few_tokens_to_carry_128_bits_is_never_reused_past():
    """Its ids could never name it safely (a 1-token image's 42 bits collide in
    2^21 tries): a re-send reuses the text before it, not it nor what follows;
    from MIN_RUN_TOKENS tokens on, a re-send hits whole."""
    assert MIN_RUN_TOKENS * 42 >= 128 > (MIN_RUN_TOKENS - 1) * 42
    for span in range(1, MIN_RUN_TOKENS + 2):
        index = PrefixIndex(max_bytes=10**6, block_size=BLOCK, namespace="m")
        first, (image,) = served_with_images([b"icon"], span, [100, 101, 102, 103, 1])
        index.insert(first, len(first.model_tokens), True)
        again, (same,) = served_with_images([b"icon"], span, [100, 101, 102, 103, 1, 2])
        hit = index.lookup(again).hit
        if span < MIN_RUN_TOKENS:
            assert hit is not None and hit.reused == len(STEM), span
        else:
            assert hit is not None and hit.reused == len(first.model_tokens), span
        assert same.key == image.key  # the tower's features are still found again
        assert engine_knowing(same).model_ids(again.model_tokens)[len(STEM)] == PLACEHOLDER


def test_an_image_of_more_tokens_than_its_ids_can_number_is_refused(monkeypatch):
    from scheduler.contracts import ImageRejected

    monkeypatch.setattr(vision, "MAX_IMAGE_TOKENS", SPAN - 1)
    front = VisionFront(_Processor(SPAN), _Tokenizer(), None, None)

    class Pixels:
        size = (640, 480)

    with pytest.raises(ImageRejected, match="640x480 image becomes 6 tokens"):
        front.image_input(Pixels(), b"big", 3)


def test_an_image_repeated_in_a_request_is_expanded_and_counted_once():
    """Each placeholder ran the processor again, and the request's image bytes
    (held against --max-image-inputs-bytes) counted a re-sent screenshot's arrays
    each time: one expansion a picture, each repeat at its own place."""
    from scheduler.request import Request, SamplingParams

    class Counting(_Processor):
        calls: list[object] = []

        def __call__(self, text, images):
            self.calls.append(images[0])
            return {**super().__call__(text, images), "pixel_values": np.zeros(1000, np.uint8)}

    processor = Counting(SPAN)
    front = VisionFront(processor, _Tokenizer(), None, None)
    cat, dog = LoadedImage("cat pixels", b"cat"), LoadedImage("dog pixels", b"dog")
    key = PromptKey.build(STEM + [PLACEHOLDER, 9, PLACEHOLDER, PLACEHOLDER, 8, 1])
    _, prompt, inputs = attach_images(key, ResolvedImages([cat, dog, cat]), front)
    assert processor.calls == ["cat pixels", "dog pixels"]
    starts = [len(STEM), len(STEM) + SPAN + 1, len(STEM) + 2 * SPAN + 1]
    assert [i.start for i in inputs] == starts
    assert inputs[0].key == inputs[2].key != inputs[1].key
    assert all(prompt[s : s + SPAN] == [PLACEHOLDER] * SPAN for s in starts)
    request = Request(prompt, 4, SamplingParams(), images=inputs)
    assert request.image_bytes == 2 * 1000


def test_the_newest_user_message_moves_with_the_text_after_an_image():
    """An image widened before the newest user message moves its start too: a
    stale start would let the alignment step over a value the user just edited."""
    key = PromptKey.build([1, PLACEHOLDER, 2, 3, 4, 5], newest_user_start=3)
    wide = expand_images(key, [(1, image_tokens(b"x", [PLACEHOLDER] * 4))])
    assert wide.newest_user_start == 6
    assert expand_images(PromptKey.build([1, PLACEHOLDER, 2]), []).newest_user_start is None
