"""Fixtures shared by the unit tests."""

from __future__ import annotations

import json

import pytest

from tests.helpers.dialects import Served, serve_scripted
from tests.helpers.http_server import serve_app
from tests.helpers.safetensors_bytes import one_element_tensors


@pytest.fixture(scope="module")
def server():
    """The scripted model-free server of the dialect tests, one per test module."""
    app = serve_scripted()
    with serve_app(app) as url:
        yield Served(url, app)


@pytest.fixture()
def adapter_dir(tmp_path):
    """The files an mlx_lm.lora adapter has (the fake engine loads no weights)."""
    config = {"fine_tune_type": "lora", "lora_parameters": {"rank": 8, "scale": 20.0}}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapters.safetensors").write_bytes(one_element_tensors(2))
    return tmp_path
