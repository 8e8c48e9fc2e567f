"""A large image prefilled across engine steps keeps its features until its
last slice: several rows mid-image must not evict each other's (stub VLM, the
real VisionPrefill)."""

from __future__ import annotations

import types

import mlx.core as mx

from engine.vision import VisionPrefill
from scheduler.request import ImageInput

WIDTH = 64  # the stub's embedding width
TOKENS = 1000  # per image
FEATURES = TOKENS * WIDTH * 4  # one image's merged embeddings (float32)
SLICE = 256  # an engine step's prefill budget


class StubVLM:
    config = types.SimpleNamespace(model_type="smolvlm")

    def get_input_embeddings(self, ids, pixels, **_):
        return types.SimpleNamespace(inputs_embeds=mx.zeros((1, ids.shape[1], WIDTH)))


class Layer:
    state = mx.zeros((1,))


def view(ids, cache=None, input_embeddings=None, position_ids=None):
    return None


def image(tag: bytes) -> ImageInput:
    return ImageInput(start=1, tokens=(7,) * TOKENS, key=tag * 32, run_key=tag * 32, inputs={})


PROMPT = [1] + [7] * TOKENS + [2]


def prefill(room_in_images: float) -> VisionPrefill:
    return VisionPrefill(StubVLM(), view, feature_bytes=int(room_in_images * FEATURES))


def step(vp: VisionPrefill, rows: dict[str, list]) -> None:
    """One engine step: a slice for each row still inside its image (as
    BatchRunner._start_waiting runs them); a row is [image, depth, resumed]."""
    for owner, row in rows.items():
        img, depth, resumed = row
        if depth < img.end:
            done, _ = vp.run(
                PROMPT, [img], depth, [Layer()], 0, max_images=1, max_tokens=SLICE,
                resume=resumed, owner=owner,
            )  # fmt: skip
            row[1:] = [done, True]


def test_rows_mid_image_do_not_evict_each_others_features():
    """Two rows' 1000-token images, 256-token slices, room for one and a half
    images' features: each row's features evicted the other's, so the tower ran
    again at every slice (8 runs for 2 images) — the stall slicing set out to end."""
    vp = prefill(1.5)
    rows = {"a": [image(b"a"), 1, False], "b": [image(b"b"), 1, False]}
    for _ in range(8):
        step(vp, rows)
    assert all(depth == img.end for img, depth, _ in rows.values())
    assert vp.counters.encoder_runs == 2  # once per image
    assert vp.counters.images_prefilled == 2
    assert vp.held_features() <= vp.feature_bytes  # pins count within the cache's cap
    assert vp.pinned() == {}  # both images ended: nothing kept for them


def test_rows_mid_image_slice_when_their_features_fit_together():
    """Room for both: each row takes one slice a step, the tower runs once each."""
    vp = prefill(2.5)
    rows = {"a": [image(b"a"), 1, False], "b": [image(b"b"), 1, False]}
    step(vp, rows)
    assert [depth for _, depth, _ in rows.values()] == [1 + SLICE, 1 + SLICE]
    assert set(vp.pinned()) == {"a", "b"}
    for _ in range(3):
        step(vp, rows)
    assert all(depth == img.end for img, depth, _ in rows.values())
    assert vp.counters.encoder_runs == 2 and vp.pinned() == {}


def test_an_image_whose_features_cannot_be_kept_runs_whole():
    """No room beside the image in progress: the next one runs whole in its
    step (one image in flight, as VisionReserve holds back) rather than run its
    tower again at every slice or hold features beyond the cache's cap."""
    vp = prefill(1.5)
    rows = {"a": [image(b"a"), 1, False], "b": [image(b"b"), 1, False]}
    step(vp, rows)
    assert rows["a"][1] == 1 + SLICE and rows["b"][1] == rows["b"][0].end
    assert set(vp.pinned()) == {"a"}
    assert vp.held_features() <= vp.feature_bytes


def test_a_row_that_leaves_mid_image_lets_its_features_go():
    """release(owner) (a row cancelled, failed or cut short mid-image): its
    features become an ordinary cache entry, evicted by the next image."""
    vp = prefill(1.2)
    rows = {"a": [image(b"a"), 1, False]}
    step(vp, rows)
    assert set(vp.pinned()) == {"a"}
    vp.release("a")
    assert vp.pinned() == {}
    rows = {"b": [image(b"b"), 1, False]}
    step(vp, rows)
    assert set(vp.pinned()) == {"b"}
    assert vp.held_features() == FEATURES  # a's evicted: only b's held
