"""Images in the prefix cache's key: another image never hits, the same one does,
and a hit never ends inside an image."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.image_ids import expand_images, image_identity, image_start, is_image_id
from kvcache.index import PrefixIndex
from kvcache.prompt_key import PromptKey, TokenSpan
from kvcache.volatile_rules import RULE_INDEX

PLACEHOLDER = 7  # what the model reads at every image position
BLOCK = 4


STEM = [90, 91, 92, 93, 94, 95, 96, 97]  # a system prompt: two full blocks


def prompt(text_before, image: bytes | None, span: int, text_after) -> PromptKey:
    """Model tokens with one image of ``span`` tokens, in the key's identity view."""
    tokens = STEM + list(text_before)
    if image is not None:
        tokens += [image_identity(image, [PLACEHOLDER] * span)] * span
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
    a = image_identity(b"x", [PLACEHOLDER] * 4)
    assert is_image_id(a) and not is_image_id(0) and not is_image_id(-1)
    assert a != image_identity(b"x", [PLACEHOLDER] * 5)
    tokens = [1, a, a, a, 2]
    assert [image_start(tokens, d) for d in range(6)] == [0, 1, 1, 1, 4, 5]


def _reminder_with_image(image: bytes, note: int) -> PromptKey:
    """STEM, then a user's <system-reminder> block (volatile, dropped from the cache
    key) holding ``note`` and a screenshot, then the question."""
    span = 6
    rule = RULE_INDEX["system_reminder"]
    tokens = STEM + [100, note, PLACEHOLDER, 101] + [102, 103, 104]
    at = len(STEM) + 2
    key = PromptKey.build(tokens, [TokenSpan(len(STEM), len(STEM) + 4, rule)])
    return expand_images(key, [(at, span, image_identity(image, [PLACEHOLDER] * span))])


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
