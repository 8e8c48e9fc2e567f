"""GET /v1/models over HTTP (model-free engine)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.http_server import serve_app
from tests.helpers.safetensors_bytes import one_element_tensors
from tests.unit.test_http_api import make_app

MODELS = "/v1/models"


@pytest.fixture()
def adapter_dir(tmp_path):
    config = {"fine_tune_type": "lora", "lora_parameters": {"rank": 8, "scale": 20.0}}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapters.safetensors").write_bytes(one_element_tensors(2))
    return tmp_path


def test_context_length_is_what_the_memory_budget_admits(adapter_dir):
    """A client sizing its context from /v1/models (8192) was refused with
    context_over_budget: the budget admits 1024 positions per request."""
    with serve_app(make_app(eos_after=3, context_length=8192, kv_budget_tokens=1024)) as url:

        def ceiling() -> int:
            return httpx.get(url + "/stats").json()["admission"]["ceiling_tokens"]

        (base,) = httpx.get(url + MODELS).json()["data"]
        assert base["context_length"] == ceiling() == 1024
        assert base["max_model_context"] == 8192
        # an adapter's weights take from the KV budget: the figure follows
        mounted = httpx.post(url + "/v1/adapters", json={"id": "sql", "path": str(adapter_dir)})
        assert mounted.status_code == 200, mounted.text
        now = ceiling()
        assert now < 1024
        for entry in httpx.get(url + MODELS).json()["data"]:
            assert entry["context_length"] == now and entry["max_model_context"] == 8192
        # what it advertises is what a request may use
        words = "w" * (now - 64)  # one token a character, and the template
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": words}], "max_tokens": 8},
        )
        assert r.status_code == 200, r.text


def test_context_length_is_the_models_when_the_budget_admits_more():
    with serve_app(make_app(eos_after=3, context_length=2048, kv_budget_tokens=4096)) as url:
        (entry,) = httpx.get(url + MODELS).json()["data"]
        assert entry["context_length"] == entry["max_model_context"] == 2048
