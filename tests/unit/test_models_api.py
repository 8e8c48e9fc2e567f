"""GET /v1/models and /v1/models/{model} over HTTP (model-free engine)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers.http_server import serve_app
from tests.unit.test_http_api import assert_error, make_app

MODELS = "/v1/models"


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


@pytest.mark.parametrize("model_id", ["fake-model", "org/fake-model"])
def test_retrieve_a_model_by_id(model_id, adapter_dir):
    """openai's models.retrieve(id) was a 404 "Not Found": the route did not exist."""
    with serve_app(make_app(eos_after=3, model_id=model_id)) as url:
        httpx.post(url + "/v1/adapters", json={"id": "sql", "path": str(adapter_dir)})
        listed = {m["id"]: m for m in httpx.get(url + MODELS).json()["data"]}
        assert set(listed) == {model_id, "sql"}
        for wanted in listed:
            r = httpx.get(url + MODELS + "/" + wanted)
            assert r.status_code == 200, r.text
            assert r.json() == listed[wanted]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert client.models.retrieve(model_id).id == model_id


def test_retrieve_an_unknown_model_is_404_model_not_found():
    with serve_app(make_app(eos_after=3)) as url:
        err = assert_error(httpx.get(url + MODELS + "/nope/x"), 404, "model_not_found")
        assert "nope/x" in err["message"]
        doc = httpx.get(url + "/openapi.json").json()["paths"]["/v1/models/{model}"]["get"]
        assert {"200", "404"} <= set(doc["responses"])
