"""Responses conformance: what the server sends, validated by the openai SDK's own types."""

from __future__ import annotations

import json

import httpx
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import serve_app

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def _events(url: str, body: dict, on_event=None) -> list[dict]:
    events = []
    with httpx.stream(
        "POST", url + "/v1/responses", json={**body, "stream": True}, timeout=30
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                STREAM_EVENT.validate_python(events[-1])
                if on_event:
                    on_event(events)
    return events


def test_a_message_cut_by_a_failure_mid_stream_is_incomplete():
    """The engine failed mid-message: the message item said "completed" inside a
    failed response, as if the text were whole."""
    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, step_delay=0.05))

    def fail_after_two_deltas(events: list[dict]) -> None:
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        if len(deltas) == 2 and events[-1] is deltas[-1]:
            app.state.kvwarm.engine.inject_fault(RuntimeError("boom"))

    with serve_app(app) as url:
        body = {"input": "hi", "max_output_tokens": 200}
        events = _events(url, body, fail_after_two_deltas)
    assert events[-1]["type"] == "response.failed"
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "failed" and final.output[-1].type == "message"
    assert final.output[-1].status == "incomplete"
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert done[-1]["item"]["status"] == "incomplete"


def test_tools_nothing_here_runs_are_reported_ignored(server):
    """Custom and hosted tools were dropped in silence: the model never saw them
    and the client was not told."""
    from tests.helpers.dialects import RESPONSES_TOOLS

    tools = [
        {"type": "custom", "name": "apply_patch", "description": "Patch files"},
        {"type": "web_search"},
        {"type": "local_shell"},
        *RESPONSES_TOOLS,
    ]
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "tools": tools})
    assert r.status_code == 200, r.text
    ignored = r.headers["x-kvwarm-ignored-fields"].split(", ")
    assert ignored == ["tools.custom", "tools.web_search", "tools.local_shell"]
    rendered = [t["function"]["name"] for t in server.formatter.last_kwargs["tools"]]
    assert rendered == ["get_weather"]
    Response.model_validate(r.json())
    plain = httpx.post(server.url + "/v1/responses", json={"input": "hi", "tools": RESPONSES_TOOLS})
    assert "x-kvwarm-ignored-fields" not in plain.headers


def test_a_text_format_not_applied_is_echoed_as_asked_and_reported(server, monkeypatch):
    """Structured output is not enforced (nor is chat's response_format): the
    response claimed {"type": "text"} whatever the client asked, so the SDK's
    parse() saw a format it had not asked for."""
    from pydantic import BaseModel

    from tests.helpers import dialects

    class City(BaseModel):
        city: str

    monkeypatch.setitem(dialects.SCRIPTS, "JSON_CITY", ['{"city": ', '"Rome"}'])
    client = server.openai()
    parsed = client.responses.with_raw_response.parse(
        model="m", input="JSON_CITY", text_format=City
    )
    assert "text.format" in parsed.headers["x-kvwarm-ignored-fields"]
    response = parsed.parse()
    assert response.output_parsed == City(city="Rome")  # the model wrote JSON: it parses
    assert response.text.format.type == "json_schema" and response.text.format.name == "City"
    Response.model_validate(json.loads(parsed.text))
    url = server.url + "/v1/responses"
    asked = {"format": {"type": "json_object"}, "verbosity": "low"}
    r = httpx.post(url, json={"input": "hi", "text": asked})
    assert r.status_code == 200 and r.json()["text"] == asked
    assert r.headers["x-kvwarm-ignored-fields"] == "text.format, text.verbosity"
    r = httpx.post(url, json={"input": "hi", "text": {"format": {"type": "text"}}})
    assert r.json()["text"] == {"format": {"type": "text"}}
    assert "x-kvwarm-ignored-fields" not in r.headers
    assert httpx.post(url, json={"input": "hi"}).json()["text"] == {"format": {"type": "text"}}
    for bad in (
        {"format": {"type": "yaml"}},
        {"format": {"type": "json_schema", "name": "x", "schema": {"d": "x" * 100_000}}},
    ):
        r = httpx.post(url, json={"input": "hi", "text": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("text"), r.text
