"""A fault while streaming a reply, outside the parser (producing or framing an
event), fails that request alone: its client gets its dialect's error event and
the engine row is freed; the connection was cut mid-chunk before."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from openai.types.responses import ResponseFailedEvent

import app.generation as generation
from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import serve_app

USER = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/chat/completions": {"messages": USER, "max_tokens": 50},
    "/v1/completions": {"prompt": "hi", "max_tokens": 50},
    "/v1/messages": {"messages": USER, "max_tokens": 50},
    "/v1/responses": {"input": "hi", "max_output_tokens": 50},
}


def _data(line: str) -> dict | None:
    if line.startswith("data: {"):
        return json.loads(line[6:])
    return None


def _ends_in_error(path: str, lines: list[str]) -> bool:
    data = [d for d in map(_data, lines) if d is not None]
    if path == "/v1/messages":
        return "event: error" in lines and data[-1]["error"]["type"] == "api_error"
    if path == "/v1/responses":
        # in the schema's own terms: its error codes are a closed list
        ResponseFailedEvent.model_validate(data[-1])
        return data[-1]["type"] == "response.failed"
    return lines[-1] == "data: [DONE]" and data[-1]["error"]["code"] == "engine_error"


@pytest.mark.parametrize("path", list(BODIES))
def test_a_fault_mid_stream_ends_with_the_dialects_error_event(monkeypatch, path):
    app = create_app(
        Settings(_env_file=None, batch=1), lambda s, r: FakeEngine(s, r, step_delay=0.01)
    )
    real, seen = generation.Outcome.add_event, []

    def flaky(self, event):
        seen.append(event)
        if len(seen) == 3:
            raise RuntimeError("injected")
        return real(self, event)

    monkeypatch.setattr(generation.Outcome, "add_event", flaky)
    with serve_app(app) as url:
        engine = app.state.kvwarm.engine
        body = {**BODIES[path], "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + path, json=body, timeout=60) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        assert _ends_in_error(path, lines), lines[-3:]
        deadline = time.monotonic() + 30
        while engine.engine_stats().active_rows and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.engine_stats().active_rows == 0
        monkeypatch.setattr(generation.Outcome, "add_event", real)
        ok = httpx.post(url + path, json=BODIES[path], timeout=60)
        assert ok.status_code == 200
