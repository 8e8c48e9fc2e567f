"""A model's JSON may escape a lone surrogate ("\\ud83d"), which UTF-8 cannot
hold: the reply must still be sent whole, in every dialect."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from app.server import create_app
from app.settings import Settings
from app.sse import framed
from tests.helpers.dialects import ANTHROPIC_TOOLS, TOOLS
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import serve_app

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\ud83dis"}, '
    '"id": "call_\\ud83d"}\n</tool_call>'
)


@pytest.fixture(scope="module")
def base():
    app = create_app(
        Settings(_env_file=None), lambda s, r: FakeEngine(s, r, script=lambda req: ["Sure.", CALL])
    )
    with serve_app(app) as url:
        yield url


def test_a_tool_call_with_a_lone_surrogate_is_answered_whole(base):
    """Non-streamed it was a 500 after the whole generation; streamed, the
    connection was cut mid-stream with no error event and no [DONE]."""
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(base + "/v1/chat/completions", json={"messages": messages, "tools": TOOLS})
    assert r.status_code == 200
    call = r.json()["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"city": "Par\ufffdis"}
    assert "\ufffd" in call["id"]  # the model's own id, as UTF-8 can hold it
    body = {"messages": messages, "tools": TOOLS, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body) as streamed:
        raw = b"".join(streamed.iter_raw())
    assert raw.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"tool_calls"' in raw
    body = {"max_tokens": 50, "messages": messages, "tools": ANTHROPIC_TOOLS, "stream": True}
    with httpx.stream("POST", base + "/v1/messages", json=body) as streamed:
        raw = b"".join(streamed.iter_raw())
    assert raw.endswith(b'data: {"type":"message_stop"}\n\n')


def test_a_frame_utf8_cannot_hold_ends_the_stream_through_its_error_path():
    """Encoded by the server after framed() returned it, the fault bypassed the
    dialect's error event."""
    errors: list[Exception] = []

    async def events():
        yield "ok"
        yield "\ud800"

    async def body() -> list[bytes]:
        return [chunk async for chunk in framed(events(), str, on_error=errors.append)]

    asyncio.run(body())  # nothing raised out of the body
    assert len(errors) == 1 and isinstance(errors[0], UnicodeEncodeError)
