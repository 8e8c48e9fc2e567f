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


def test_the_measured_decode_rate_survives_an_adapters_series_going():
    """An unmounted adapter's counter series are removed; its requests' decode
    time stays in the histogram: the rate read from both dropped (or vanished)."""
    app = make_app(eos_after=5)
    with serve_app(app) as base:
        httpx.post(
            base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        before = httpx.get(base + "/fit").json()["decode"]["per_stream_tok_s"]
        app.state.kvwarm.obs.metrics.forget_adapter("")  # as an unmount forgets its id
        after = httpx.get(base + "/fit").json()["decode"]["per_stream_tok_s"]
    assert before is not None and after == before


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


def test_fits_apple_matrix_prices_a_served_gguf_as_a_mac_loads_it(tmp_path):
    """Served from a GGUF, the model's folder is its float32 conversion for the
    CPU backend: the matrix priced that, 5x the weights a Mac would load."""
    from dataclasses import replace

    from app.model_library import gguf_facts
    from scheduler.fit import apple_matrix

    converted = write_model(tmp_path / "converted", LLAMA, {"w": ("F32", [64, 2**20])})
    app = make_app(eos_after=3)
    with serve_app(app) as base:
        engine = app.state.kvwarm.engine
        engine._model_info = replace(  # noqa: SLF001 - as the engine boots a GGUF
            engine.model_info, path=str(converted), source_path=str(smollm_gguf())
        )
        fit = httpx.get(base + "/fit").json()
    assert fit["apple_matrix"] == apple_matrix(gguf_facts(smollm_gguf()))
