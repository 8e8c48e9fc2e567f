"""A real Prometheus scrapes a real kvwarm under multi-turn load; every query of
the Grafana dashboard must return data, and the hit rate Prometheus computes
must match the cached tokens the clients were told about."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import kvwarm_server
from tests.helpers.http_server import free_port, wait_for_process
from tests.helpers.tools import ROOT, prometheus

DASHBOARD = ROOT / "deploy" / "grafana" / "kvwarm-dashboard.json"
SYSTEM = "You are a terse assistant. Answer in a few words. " * 8


@pytest.fixture(scope="module")
def monitored(model_cache, tmp_path_factory):
    d = tmp_path_factory.mktemp("monitoring")
    args = ("--batch", "4", "--log-json", "--cache-trace-dir", str(d / "traces"))
    with kvwarm_server(model_cache, *args, log=d / "kvwarm.log") as base:
        yield base, d


@pytest.fixture(scope="module")
def prom(monitored, tmp_path_factory):
    binary = prometheus()
    base, _ = monitored
    d = tmp_path_factory.mktemp("prometheus")
    config = d / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: kvwarm\n    static_configs: [{{targets: ['{urlparse(base).netloc}']}}]\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={d / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=(d / "prometheus.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_process(proc, url + "/-/ready", d / "prometheus.log", "prometheus", 30)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def query(prom_url: str, expr: str) -> list:
    r = httpx.get(prom_url + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def scalar(prom_url: str, expr: str) -> float | None:
    result = query(prom_url, expr)
    return float(result[0]["value"][1]) if result else None


def agent_load(base: str) -> tuple[int, int]:
    """Two agents over three turns each (chat and Messages, streaming and not);
    returns the prompt and cached tokens the clients were told about."""
    oa = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0, timeout=120)
    prompt = cached = 0
    tag = uuid.uuid4().hex[:6]
    chat = [{"role": "system", "content": f"[{tag}] {SYSTEM}"}]
    messages: list = []
    for turn in ("Name a colour.", "Name a fruit.", "Name a tree."):
        chat.append({"role": "user", "content": turn})
        stream = oa.chat.completions.create(
            model="m",
            messages=chat,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"session_id": f"{tag}-chat"},
        )
        reply, usage = "", None
        for chunk in stream:
            if chunk.choices:
                reply += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        prompt += usage.prompt_tokens
        cached += usage.prompt_tokens_details.cached_tokens
        chat.append({"role": "assistant", "content": reply})

        messages.append({"role": "user", "content": turn})
        msg = an.messages.create(
            model="m",
            system=f"[{tag}-a] {SYSTEM}",
            messages=messages,
            max_tokens=8,
            extra_body={"temperature": 0},
        )
        prompt += msg.usage.input_tokens + msg.usage.cache_read_input_tokens
        cached += msg.usage.cache_read_input_tokens
        messages.append({"role": "assistant", "content": [b.model_dump() for b in msg.content]})
    return prompt, cached


def test_dashboard_queries_return_data_and_hit_rate_matches_clients(monitored, prom):
    base, workdir = monitored
    prompt, cached = agent_load(base)
    assert cached > 0
    # a refused request, so the rejection panel has a non-zero series too
    httpx.post(
        base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
    )
    deadline = time.monotonic() + 30
    while scalar(prom, "sum(kvwarm:prefix_cache_queries_total)") != prompt:
        assert time.monotonic() < deadline, "Prometheus never saw the final counters"
        time.sleep(0.5)
    time.sleep(2)  # a few more scrapes for the rate() windows
    assert scalar(prom, "sum(kvwarm:prefix_cache_hits_total)") == cached
    hit_rate = scalar(
        prom, "sum(kvwarm:prefix_cache_hits_total) / sum(kvwarm:prefix_cache_queries_total)"
    )
    assert hit_rate == pytest.approx(cached / prompt)
    assert scalar(prom, 'sum(kvwarm:requests_rejected_total{reason="over_context"})') == 1

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 20
    for expr in exprs:
        concrete = expr.replace("$model", ".*").replace("$__rate_interval", "1m")
        assert query(prom, concrete), f"no data for panel query: {expr}"


def test_request_lines_and_cache_traces(monitored, prom):
    _, workdir = monitored
    lines = [
        json.loads(x)
        for x in (workdir / "kvwarm.log").read_text().splitlines()
        if x.startswith("{")
    ]
    done = [x for x in lines if x.get("logger") == "kvwarm.request"]
    assert done, "no JSON request lines"
    for line in done:
        assert {
            "request_id",
            "session",
            "dialect",
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
            "queue_s",
            "prefill_s",
            "decode_s",
            "tokens_per_s",
            "finish",
            "cache_layer",
            "cache_depth",
        } <= set(line)
    traces = list(Path(workdir / "traces").glob("*-chat.jsonl"))
    assert traces, "no cache trace for the chat session"
    turns = [json.loads(x) for x in traces[0].read_text().splitlines()]
    assert len(turns) == 3 and turns[0]["cached_tokens"] <= turns[1]["cached_tokens"]
    assert turns[2]["cache_layer"] in ("global", "session") and turns[2]["cache_depth"] > 0
