"""LoRA adapters on the real model over HTTP.

Two adapters built with mlx-lm's own LoRA layers for SmolLM2: one mounted at
start (--adapter), one through POST /v1/adapters. Greedy replies must be exactly
mlx-lm's (``load(..., adapter_path=...)`` + ``generate_step``) for each adapter,
also while rows of both adapters and of the base model decode in one batch, and
the prefix cache never hands one adapter's KV to another.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from tests.e2e.conftest import kvwarm_server
from tests.helpers.adapters import write_adapter

MAX_TOKENS = 16
KEYS = ["self_attn.q_proj", "self_attn.v_proj"]


@pytest.fixture(scope="module")
def model_dir(model_cache) -> Path:
    (path,) = [p for p in (model_cache / "models").iterdir() if (p / "config.json").exists()]
    return path


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smollm-adapters")
    return {
        "alpha": write_adapter(model_dir, root / "alpha", seed=11, rank=8, keys=KEYS, num_layers=8),
        "beta": write_adapter(model_dir, root / "beta", seed=12, rank=4, keys=KEYS, num_layers=8),
    }


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    _, tokenizer = load(str(model_dir))
    texts = [
        "The three laws of thermodynamics are",
        "A short poem about the sea:\n",
        "def fibonacci(n):\n    ",
    ]
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def references(model_dir, adapter_dirs, prompts) -> dict[tuple[str, int], str]:
    """mlx-lm's greedy text for each (adapter or base, prompt)."""
    out = {}
    for name in (None, "alpha", "beta"):
        path = str(adapter_dirs[name]) if name else None
        model, tokenizer = load(str(model_dir), adapter_path=path)
        for i, prompt in enumerate(prompts):
            tokens = [
                int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS)
            ]
            out[(name or "", i)] = tokenizer.decode(tokens)
    return out


@pytest.fixture(scope="module")
def adapter_server(model_cache, adapter_dirs, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-adapters") / "kvwarm.log"
    args = (
        "--batch",
        "8",
        "--adapter",
        f"alpha={adapter_dirs['alpha']}",
        "--cache-block-size",
        "8",
    )
    with kvwarm_server(model_cache, *args, log=log) as base:
        yield base


def complete(base: str, prompt: list[int], adapter: str | None, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if adapter:
        body["adapter"] = adapter
    r = httpx.post(base + "/v1/completions", json={**body, **extra}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_adapters_give_mlx_lm_output_alone_and_batched_together(
    adapter_server, adapter_dirs, prompts, references
):
    base = adapter_server
    r = httpx.post(base + "/v1/adapters", json={"id": "beta", "path": str(adapter_dirs["beta"])})
    assert r.status_code == 200, r.text
    listed = {a["id"]: a for a in httpx.get(base + "/v1/adapters").json()["data"]}
    assert set(listed) == {"alpha", "beta"}
    assert listed["alpha"]["rank"] == 8 and listed["beta"]["mounted_layers"] == 16
    assert references[("alpha", 0)] != references[("", 0)] != references[("beta", 0)]
    # nine requests at once: every (adapter, prompt) pair in one continuous batch
    jobs = [(name, i) for name in ("", "alpha", "beta") for i in range(len(prompts))]
    got: dict[tuple[str, int], str] = {}

    def run(job):
        got[job] = complete(base, prompts[job[1]], job[0] or None, session_id=f"mix-{job}")[
            "choices"
        ][0]["text"]

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {job: references[job] for job in jobs}
    sizes = httpx.get(base + "/stats").json()
    assert sizes["engine"]["row_faults"] == 0


def test_no_cache_hit_crosses_adapters(adapter_server, prompts, references):
    base = adapter_server
    # a prompt no other test sent, long enough for several cache blocks
    prompt = list(range(3000, 3040)) + prompts[0] * 3
    first = complete(base, prompt, "alpha")
    again = complete(base, prompt, "alpha")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    for other in ("beta", None):
        r = complete(base, prompt, other)
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, other
        assert r["choices"][0]["text"] != first["choices"][0]["text"]


def test_mount_and_unmount_under_load_fail_no_running_request(
    adapter_server, adapter_dirs, prompts, references
):
    base = adapter_server
    results: list[dict] = []

    def run(i):
        results.append(complete(base, prompts[i % 3], "alpha", max_tokens=48))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for _ in range(3):  # mount and unmount a third adapter while they decode
        r = httpx.post(
            base + "/v1/adapters", json={"id": "gamma", "path": str(adapter_dirs["beta"])}
        )
        assert r.status_code == 200, r.text
        assert httpx.delete(base + "/v1/adapters/gamma").status_code == 200
    busy = httpx.delete(base + "/v1/adapters/alpha")
    for t in threads:
        t.join()
    assert busy.status_code in (200, 409)
    assert len(results) == 4
    assert all(r["choices"][0]["finish_reason"] == "length" for r in results)
    assert all(r["usage"]["completion_tokens"] == 48 for r in results)
    if busy.status_code == 200:  # every request had already finished: mount it back
        httpx.post(base + "/v1/adapters", json={"id": "alpha", "path": str(adapter_dirs["alpha"])})


def test_bad_adapters_are_400(adapter_server, tmp_path, adapter_dirs):
    base = adapter_server
    r = httpx.post(base + "/v1/adapters", json={"id": "x", "path": str(tmp_path)})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "adapter": "missing"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_not_found"
