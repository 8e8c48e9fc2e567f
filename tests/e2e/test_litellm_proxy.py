"""client -> LiteLLM proxy (deploy/ config) -> kvwarm: a streamed chat completion
arrives with its reasoning_content and usage intact."""

from __future__ import annotations

import os
import subprocess

import openai

from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine, prompt_text
from tests.helpers.http_server import free_port, serve_app, wait_for_process
from tests.helpers.tools import ROOT, litellm

CONFIG = ROOT / "deploy" / "litellm" / "litellm-config.yaml"
REPLY = ["<think>", "Plan the ", "answer.</think>", "\n\nParis ", "it is."]


def test_streaming_through_litellm_keeps_reasoning_and_usage(tmp_path):
    binary = litellm()

    def script(req):
        return REPLY if "capital" in prompt_text(req) else None

    app = create_app(
        Settings(_env_file=None, api_key="kv-key"), lambda s, r: FakeEngine(s, r, script=script)
    )
    with serve_app(app) as kvwarm:
        port = free_port()
        env = {
            **os.environ,
            "KVWARM_API_BASE": kvwarm + "/v1",
            "KVWARM_UPSTREAM_KEY": "kv-key",
            "LITELLM_MASTER_KEY": "sk-proxy",
            "LITELLM_TELEMETRY": "False",
            "NO_DOCS": "True",
        }
        log = (tmp_path / "litellm.log").open("w")
        proc = subprocess.Popen(
            [binary, "--config", str(CONFIG), "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            liveness = url + "/health/liveliness"
            wait_for_process(proc, liveness, tmp_path / "litellm.log", "litellm", 180)
            client = openai.OpenAI(base_url=url, api_key="sk-proxy", max_retries=0, timeout=60)
            reasoning, content, usage = "", "", None
            for chunk in client.chat.completions.create(
                model="local",
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                stream=True,
                stream_options={"include_usage": True},
            ):
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                    content += delta.content or ""
                usage = chunk.usage or usage
        finally:
            proc.terminate()
            proc.wait(20)
    assert reasoning == "Plan the answer."
    assert content == "Paris it is."
    assert usage is not None
    assert usage.completion_tokens == len(REPLY)
    assert usage.prompt_tokens == usage.total_tokens - usage.completion_tokens > 0
