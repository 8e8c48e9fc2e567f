"""GET /fit and GET /library over HTTP (model-free engine)."""

from __future__ import annotations

import httpx

from app.settings import Settings
from tests.helpers.http_server import serve_app
from tests.unit.test_fit import LLAMA, smollm_gguf, write_model
from tests.unit.test_http_api import make_app


def test_fit_reports_machine_admission_decode_and_matrix():
    with serve_app(make_app(eos_after=3)) as base:
        httpx.post(
            base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        fit = httpx.get(base + "/fit").json()
        stats = httpx.get(base + "/stats").json()["admission"]
    assert set(fit) == {"machine", "model", "admission", "decode", "apple_matrix"}
    assert fit["machine"]["memory_bytes"] > 0 and fit["machine"]["name"]
    # the ceiling /fit shows is the one admission enforces
    assert fit["admission"]["ceiling_tokens"] == stats["ceiling_tokens"]
    assert fit["admission"]["kv_budget_bytes"] == stats["kv_budget_bytes"]
    assert fit["model"]["id"] == "fake-model"
    assert fit["decode"]["at_context"] == 2048
    assert fit["decode"]["per_stream_tok_s"] is not None  # from this server's own metrics


def test_library_lists_models_with_an_assessment(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    write_model(hub / "models--org--tiny" / "snapshots" / "r1", LLAMA, {"w": ("F16", [64, 64])})
    folder = tmp_path / "models"
    (folder).mkdir()
    (folder / "smol.gguf").symlink_to(smollm_gguf())
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("KVWARM_CACHE_DIR", str(tmp_path / "cache"))
    settings = Settings(_env_file=None, model_dir=[str(folder)])
    with serve_app(make_app(settings, eos_after=3)) as base:
        body = httpx.get(base + "/library").json()
    by_id = {m["id"]: m for m in body["data"]}
    assert set(by_id) == {"org/tiny", "smol.gguf"}
    smol = by_id["smol.gguf"]
    assert smol["type"] == "llama" and smol["format"] == "gguf" and smol["quant_bits"] == 4
    assert smol["supported"] and smol["serving"] is False and smol["vision"] is False
    assert smol["fit"]["verdict"] in ("fits", "tight", "no")
    assert set(smol) >= {"id", "type", "size_bytes", "quant_bits", "vision", "supported", "serving"}
