"""--vision auto|on|off against a model directory's config.json."""

from __future__ import annotations

import json

import pytest

from engine.model_errors import UnsupportedModelError
from engine.vision import wants_vision


def model_dir(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "family",
    ["idefics3", "smolvlm", "gemma3", "llava", "pixtral", "mistral3", "qwen2_vl", "qwen2_5_vl"],
)
def test_served_vision_families_are_detected(tmp_path, family):
    path = model_dir(tmp_path, {"model_type": family, "vision_config": {}})
    assert wants_vision(path, "auto") and wants_vision(path, "on")
    assert not wants_vision(path, "off")


def test_an_unserved_vision_family_is_refused_under_on_and_text_only_under_auto(tmp_path):
    path = model_dir(tmp_path, {"model_type": "llava_next", "vision_config": {}})
    assert not wants_vision(path, "auto")
    with pytest.raises(UnsupportedModelError, match="'llava_next' is not served yet"):
        wants_vision(path, "on")


def test_vision_on_for_a_text_model_says_it_is_not_one(tmp_path):
    path = model_dir(tmp_path, {"model_type": "llama"})
    assert not wants_vision(path, "auto")
    with pytest.raises(UnsupportedModelError, match="not a vision model"):
        wants_vision(path, "on")


def test_min_pixels_over_max_pixels_is_refused_at_start():
    from pydantic import ValidationError

    from app.settings import Settings

    with pytest.raises(ValidationError, match="--min-pixels 10 is over --max-pixels 5"):
        Settings(min_pixels=10, max_pixels=5)
    assert Settings(min_pixels=5, max_pixels=5).max_pixels == 5
