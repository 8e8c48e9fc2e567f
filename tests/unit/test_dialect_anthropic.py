"""Anthropic Messages over a real socket, parsed by the official anthropic SDK."""

from __future__ import annotations

import json
import re
import time

import anthropic
import httpx
import openai
import pytest

from app.server import create_app
from app.settings import Settings
from tests.helpers.dialects import (
    ANTHROPIC_TOOLS,
    PROMPTS,
    QWEN_CALL,
    REQUESTS,
)
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import serve_app


def test_anthropic_tool_use_non_streaming(server):
    msg = server.anthropic().messages.create(
        model="claude-x",
        max_tokens=64,
        system=[{"type": "text", "text": "You help.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "CALL_TOOL"}],
        tools=ANTHROPIC_TOOLS,
    )
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "Need the weather."
    assert msg.content[1].text == "Checking.\n"
    assert msg.content[2].name == "get_weather" and msg.content[2].input == {
        "city": "Paris",
        "days": 3,
    }
    assert msg.content[2].id.startswith("toolu_")
    assert msg.stop_reason == "tool_use"
    assert msg.usage.output_tokens == len(QWEN_CALL)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0
    assert server.formatter.last_messages[0] == {"role": "system", "content": "You help."}


def test_anthropic_stream_event_grammar_and_accumulated_message(server):
    client = server.anthropic()
    kwargs = dict(
        model="c",
        max_tokens=64,
        messages=[{"role": "user", "content": "CALL_TOOL"}],
        tools=ANTHROPIC_TOOLS,
    )
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta"
    starts = kinds.count("content_block_start")
    assert starts == kinds.count("content_block_stop") == 3
    whole = client.messages.create(**kwargs)
    assert [b.type for b in final.content] == [b.type for b in whole.content]
    assert final.content[0].thinking == whole.content[0].thinking
    assert final.content[1].text == whole.content[1].text
    assert final.content[2].input == whole.content[2].input
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_anthropic_tool_result_round_trip_and_stop_sequence(server):
    client = server.anthropic()
    first = client.messages.create(
        model="c",
        max_tokens=64,
        messages=[{"role": "user", "content": "CALL_TOOL"}],
        tools=ANTHROPIC_TOOLS,
    )
    tool_use = first.content[2]
    follow = [
        {"role": "user", "content": "CALL_TOOL"},
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": tool_use.id,
                    "content": [{"type": "text", "text": "sunny"}],
                },
                {"type": "text", "text": "and tomorrow?"},
            ],
        },
    ]
    second = client.messages.create(
        model="c", max_tokens=64, messages=follow, tools=ANTHROPIC_TOOLS, stop_sequences=["w2"]
    )
    seen = server.formatter.last_messages
    assert seen[1]["role"] == "assistant"
    assert seen[1]["tool_calls"][0]["id"] == tool_use.id
    assert seen[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Paris", "days": 3},
    }
    assert seen[2] == {"role": "tool", "tool_call_id": tool_use.id, "content": "sunny"}
    assert seen[3] == {"role": "user", "content": "and tomorrow?"}
    assert second.stop_reason in ("end_turn", "stop_sequence", "max_tokens")


def test_anthropic_count_tokens_and_errors(server):
    client = server.anthropic()
    counted = client.messages.count_tokens(
        model="c", messages=[{"role": "user", "content": "hello"}]
    )
    assert counted.input_tokens == len("<user>hello<assistant>")
    # counting declares no stop_sequences: whatever JSON it holds is ignored, never a 500
    for stops in (1, True, {"a": 1}, ["a", 1]):
        r = httpx.post(
            server.url + "/v1/messages/count_tokens",
            json={"messages": [{"role": "user", "content": "hello"}], "stop_sequences": stops},
        )
        assert r.status_code == 200 and r.json()["input_tokens"] == counted.input_tokens
    r = httpx.post(
        server.url + "/v1/messages",
        json={"model": "c", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model="c",
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        )


def test_anthropic_accepts_its_headers_with_an_api_key():
    app = create_app(
        Settings(_env_file=None, api_key="sekret"), lambda s, r: FakeEngine(s, r, eos_after=2)
    )
    with serve_app(app) as url:
        ok = anthropic.Anthropic(base_url=url, api_key="sekret", max_retries=0)
        assert ok.messages.create(
            model="c", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        ).content
        bad = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(
                model="c", max_tokens=4, messages=[{"role": "user", "content": "x"}]
            )


def test_anthropic_mid_stream_engine_failure_is_an_error_event():
    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, step_delay=0.05))
    with serve_app(app) as url:
        body = {
            "model": "c",
            "max_tokens": 200,
            "stream": True,
            "messages": [{"role": "user", "content": "x"}],
        }
        with httpx.stream("POST", url + "/v1/messages", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            events = []
            for line in lines:
                if line.startswith("event: "):
                    events.append(line[7:])
                    if events.count("content_block_delta") == 2:
                        app.state.kvwarm.engine.inject_fault(RuntimeError("boom"))
                if line.startswith("data: ") and events and events[-1] == "error":
                    error = json.loads(line[6:])
                    break
    assert events[0] == "message_start" and events[-1] == "error"
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "boom" in error["error"]["message"]
    assert "message_stop" not in events


def test_anthropic_error_types_follow_the_status():
    from app.errors import anthropic_error_body

    kinds = {
        s: anthropic_error_body(s, "m")["error"]["type"] for s in (400, 404, 413, 429, 500, 503)
    }
    assert kinds == {
        400: "invalid_request_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        503: "overloaded_error",
    }


def test_anthropic_max_tokens_fits_the_context_but_chat_is_refused(server):
    big = [{"role": "user", "content": "x"}]
    with server.anthropic().messages.stream(model="c", max_tokens=32000, messages=big) as stream:
        msg = stream.get_final_message()
    assert msg.stop_reason == "end_turn"  # Claude Code's 32000 is fitted to the 2048 context
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        server.openai().chat.completions.create(model="m", messages=big, max_tokens=32000)


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_ending_in_a_call_names_no_stop_sequence(server, stream):
    """stop_reason tool_use came with the stop sequence that cut the text after the
    call; Anthropic names one only with stop_reason stop_sequence."""
    kw = dict(
        model="c",
        max_tokens=64,
        messages=[{"role": "user", "content": "SANDWICH"}],
        tools=ANTHROPIC_TOOLS,
        stop_sequences=["After"],
    )
    client = server.anthropic()
    if stream:
        with client.messages.stream(**kw) as events:
            msg = events.get_final_message()
    else:
        msg = client.messages.create(**kw)
    assert (msg.stop_reason, msg.stop_sequence) == ("tool_use", None)
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    plain = client.messages.create(
        model="c", max_tokens=64, messages=[{"role": "user", "content": "x"}], stop_sequences=["w2"]
    )
    assert (plain.stop_reason, plain.stop_sequence) == ("stop_sequence", "w2")


def test_consecutive_turns_of_one_role_are_joined_as_anthropic_joins_them(server):
    """Two user turns in a row reached the template as two: templates that want
    roles to alternate (Gemma, Mistral) refused the request."""
    client = server.anthropic()
    messages = [
        {"role": "user", "content": "first"},
        {"role": "user", "content": [{"type": "text", "text": "second"}]},
        {"role": "assistant", "content": "let me look"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                {"type": "text", "text": "and?"},
            ],
        },
        {"role": "user", "content": "well?"},
    ]
    client.messages.create(model="c", max_tokens=4, messages=messages, tools=ANTHROPIC_TOOLS)
    seen = server.formatter.last_messages
    assert [m["role"] for m in seen] == ["user", "assistant", "tool", "user"]
    assert seen[0]["content"] == "first\nsecond"
    assert seen[1]["content"] == "let me look" and seen[1]["tool_calls"][0]["id"] == "t1"
    assert seen[3]["content"] == "and?\nwell?"


def test_plain_text_documents_are_read_and_a_pdf_is_named_as_one(server):
    """A text document was refused (400) in a user turn and replaced by the image
    note inside a tool result: its text never reached the model."""
    import anthropic

    client = server.anthropic()
    text_doc = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "The code is 42."},
        "title": "notes.txt",
    }
    blocks_doc = {
        "type": "document",
        "source": {"type": "content", "content": [{"type": "text", "text": "Line one."}]},
    }
    pdf = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
    }
    messages = [
        {"role": "user", "content": [text_doc, {"type": "text", "text": "what is the code?"}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [blocks_doc, pdf]},
            ],
        },
    ]
    client.messages.create(model="c", max_tokens=4, messages=messages, tools=ANTHROPIC_TOOLS)
    seen = server.formatter.last_messages
    assert seen[0]["content"] == "notes.txt\nThe code is 42.\nwhat is the code?"
    assert seen[2]["content"] == (
        "Line one.\n[document omitted: this model reads plain-text documents only]"
    )
    with pytest.raises(anthropic.BadRequestError, match="document"):
        client.messages.create(
            model="c", max_tokens=4, messages=[{"role": "user", "content": [pdf]}]
        )


def test_anthropic_defined_client_tools_reach_the_model_and_server_tools_are_named(server):
    """bash and the text editor are tools the client runs: they were dropped like
    server tools (the model never saw them, and naming one in tool_choice was a
    400); server tools nothing here runs are now named in the ignored-fields header."""
    import httpx

    body = {
        "model": "c",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [
            {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
            {"type": "bash_20250124", "name": "bash"},
            {"type": "memory_20250818", "name": "memory"},
            {"type": "web_search_20250305", "name": "web_search"},
        ],
        "tool_choice": {"type": "tool", "name": "bash"},
    }
    r = httpx.post(
        server.url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}
    )
    assert r.status_code == 200, r.text
    tools = {t["function"]["name"]: t["function"] for t in server.formatter.last_kwargs["tools"]}
    assert set(tools) == {"str_replace_based_edit_tool", "bash", "memory"}
    assert tools["str_replace_based_edit_tool"]["parameters"]["required"] == ["command", "path"]
    memory = tools["memory"]["parameters"]["properties"]
    assert {"rename", "delete"} <= set(memory["command"]["enum"]) and "new_path" in memory
    assert "tools.web_search_20250305" in r.headers["x-kvwarm-ignored-fields"]


def test_a_final_assistant_turn_stays_the_prefill_after_another_assistant_turn(server):
    """Joined into the assistant turn before it (which held thinking), the final
    assistant message lost its place as the prefill the reply continues."""
    client = server.anthropic()
    history = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "text", "text": "A"},
            ],
        },
        {"role": "assistant", "content": '{"a":'},
    ]
    client.messages.create(model="c", max_tokens=4, messages=history)
    assert PROMPTS[-1].endswith('<assistant>{"a":')
    assert server.formatter.last_messages[-1]["content"] == "A"


def test_a_prompt_over_the_context_is_refused_in_anthropics_words(server):
    """Claude Code reads "prompt is too long" to compact the conversation; it got
    OpenAI's "maximum context length" sentence and just failed."""
    import anthropic

    big = [{"role": "user", "content": "x" * 3000}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        server.anthropic().messages.create(model="c", max_tokens=100, messages=big)
    message = refused.value.body["error"]["message"]
    assert re.fullmatch(r"prompt is too long: (\d+) tokens > 2048 maximum", message), message
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        server.openai().chat.completions.create(model="m", messages=big, max_tokens=100)


def test_a_final_assistant_message_is_continued_not_closed(server):
    """Anthropic's prefill: the reply starts with the final assistant message's text
    (it was rendered as a closed turn, and a new one opened after it)."""
    client = server.anthropic()
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": '{"a":'}]
    msg = client.messages.create(model="c", max_tokens=4, messages=history)
    assert server.formatter.last_messages[-1] == {"role": "user", "content": "x"}
    assert PROMPTS[-1].endswith('<assistant>{"a":')  # the generation prompt, then the prefill
    assert msg.content[0].text and not msg.content[0].text.startswith('{"a":')  # only what it adds
    assert REQUESTS[-1].trim_leading_space is False  # "The answer is" + " 42", not "42"
    counted = client.messages.count_tokens(model="c", messages=history).input_tokens
    alone = client.messages.count_tokens(model="c", messages=history[:1]).input_tokens
    assert counted > alone


def test_anthropic_images_in_tool_results_become_a_note(server):
    """However many: none is read, so --max-images (5) does not refuse the turn."""
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    history = [
        {"role": "user", "content": "shot"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [image] * 6 + [{"type": "text", "text": "ok"}],
                }
            ],
        },
    ]
    server.anthropic().messages.create(
        model="c", max_tokens=4, messages=history, tools=ANTHROPIC_TOOLS
    )
    tool = server.formatter.last_messages[-1]
    assert tool["role"] == "tool" and tool["content"].startswith("[image omitted")


def test_anthropic_thinking_is_off_unless_asked_and_tool_errors_are_marked(server):
    client = server.anthropic()
    client.messages.create(model="c", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert server.formatter.last_kwargs["enable_thinking"] is False
    history = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t",
                    "is_error": True,
                    "content": "no such city",
                }
            ],
        },
    ]
    client.messages.create(
        model="c",
        max_tokens=2,
        messages=history,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert server.formatter.last_kwargs["enable_thinking"] is True
    assert server.formatter.last_messages[-1]["content"] == "Error: no such city"
    del history[-1]["content"][0]["content"]  # a failure that says nothing more
    client.messages.create(model="c", max_tokens=2, messages=history)
    assert server.formatter.last_messages[-1]["content"] == "Error"


def test_anthropic_system_turns_and_validation_messages_name_the_value(server):
    client = server.anthropic()
    history = [
        {"role": "user", "content": "x"},
        {"role": "system", "content": "Be brief."},  # Claude Code sends these
        {"role": "user", "content": "y"},
    ]
    client.messages.create(model="c", max_tokens=2, messages=history)
    assert server.formatter.last_messages[1] == {"role": "system", "content": "Be brief."}
    r = httpx.post(
        server.url + "/v1/messages",
        json={"model": "c", "max_tokens": 2, "messages": [{"role": "robot", "content": "x"}]},
    )
    assert r.status_code == 400 and "(got 'robot')" in r.json()["error"]["message"]


def test_message_start_reports_the_cache_read_already_known(monkeypatch):
    """It said no cache read however much was reused; only message_delta had it, so a
    client reading message_start alone never saw a hit."""
    from tests.helpers.fake_engine import FakeRunner

    add = FakeRunner.add

    def reusing(self, request):
        out = add(self, request)
        out.cached_tokens = 3
        return out

    monkeypatch.setattr(FakeRunner, "add", reusing)
    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, eos_after=2))
    body = {"model": "m", "max_tokens": 4, "stream": True}
    body["messages"] = [{"role": "user", "content": "hello there"}]
    with serve_app(app) as url, httpx.stream("POST", url + "/v1/messages", json=body) as r:
        first = next(json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: "))
    usage = first["message"]["usage"]
    assert first["type"] == "message_start" and usage["cache_read_input_tokens"] == 3
    assert usage["input_tokens"] > 0


def test_a_call_id_the_model_wrote_is_the_tool_use_id():
    """Chat and Responses kept the model's own id; Anthropic made a new toolu_ one,
    so the next turn's history held an id the model never wrote (a template that
    renders ids read different tokens: the previous reply's KV missed)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "abcDEF123"}'
    app = create_app(
        Settings(_env_file=None),
        lambda s, r: FakeEngine(s, r, script=lambda req: [call + "\n</tool_call>"]),
    )
    kwargs = dict(
        model="c",
        max_tokens=64,
        messages=[{"role": "user", "content": "x"}],
        tools=ANTHROPIC_TOOLS,
    )
    with serve_app(app) as url:
        client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
    for message in (whole, streamed):
        (block,) = [b for b in message.content if b.type == "tool_use"]
        assert block.id == "abcDEF123"


def test_stream_null_is_a_whole_reply(server):
    """Proxies send null for a field the caller left unset; chat and Responses read
    ``stream: null`` as false, Anthropic refused it with a 400."""
    body = {"model": "c", "max_tokens": 3, "stream": None}
    body["messages"] = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/v1/messages", json=body)
    assert r.status_code == 200 and r.json()["type"] == "message"


def _scripted_app(pieces: list[str], **settings):
    return create_app(
        Settings(_env_file=None, **settings),
        lambda s, r: FakeEngine(s, r, script=lambda req: pieces),
    )


def _hermes(city: str, call_id: str) -> str:
    call = {"name": "get_weather", "arguments": {"city": city}, "id": call_id}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>\n"


def test_tool_use_ids_are_unique_and_legal_whatever_the_model_wrote():
    """The model's own id was the tool_use id unchecked: two calls it numbered "1"
    shared an id (Claude Code pairs results with calls by id), and "call 1/x" was
    one Anthropic refuses in the next turn."""
    from anthropic.types import Message

    pieces = [_hermes("Rome", "1"), _hermes("Oslo", "1"), _hermes("Kyiv", "call 1/x")]
    kwargs = dict(
        model="c", max_tokens=64, messages=[{"role": "user", "content": "x"}], tools=ANTHROPIC_TOOLS
    )
    with serve_app(_scripted_app(pieces)) as url:
        client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        whole = httpx.post(url + "/v1/messages", json=kwargs).json()
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
    for message in (Message.model_validate(whole), streamed):
        ids = [b.id for b in message.content if b.type == "tool_use"]
        assert len(ids) == 3 and len(set(ids)) == 3, ids
        assert ids[0] == "1"  # the model's own, where it may stand
        assert all(re.fullmatch(r"[a-zA-Z0-9_-]+", i) for i in ids), ids
        assert ids[1].startswith("toolu_") and ids[2].startswith("toolu_")


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_at_a_limit_lowered_to_the_context_says_so(stream):
    """max_tokens lowered to the room the context leaves, a reply cut there said
    ``max_tokens``, as if the client's own limit had been reached."""
    from anthropic.types import Message

    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, context_length=64))
    body = {"model": "c", "messages": [{"role": "user", "content": "x"}]}
    with serve_app(app) as url:
        client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        reasons = {}
        for max_tokens in (1000, 5):  # lowered to the context's room; the client's own
            kwargs = {**body, "max_tokens": max_tokens}
            if stream:
                with client.messages.stream(**kwargs) as events:
                    msg = events.get_final_message()
            else:
                msg = Message.model_validate(httpx.post(url + "/v1/messages", json=kwargs).json())
            reasons[max_tokens] = msg.stop_reason
    assert reasons == {1000: "model_context_window_exceeded", 5: "max_tokens"}


def test_a_thinking_budget_is_named_as_ignored(server):
    """budget_tokens (Claude Code: 31999) turns thinking on and caps nothing: it was
    dropped in silence, where other unread fields are named."""
    body = {"model": "c", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    thinking = {"type": "enabled", "budget_tokens": 31999}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(server.url + path, json={**body, "thinking": thinking})
        assert r.status_code == 200, r.text
        assert "thinking.budget_tokens" in r.headers["x-kvwarm-ignored-fields"]
    assert server.formatter.last_kwargs["enable_thinking"] is True
    plain = httpx.post(server.url + "/v1/messages", json={**body, "thinking": {"type": "enabled"}})
    assert "x-kvwarm-ignored-fields" not in plain.headers


def test_every_response_names_its_request_in_the_header_its_sdk_reads(server, caplog):
    """No request id went back: Anthropic's SDK reads ``request-id`` (message._request_id,
    an error's request_id), OpenAI's ``x-request-id``; both were None."""
    import logging

    client = server.anthropic()
    kw = dict(model="c", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    with caplog.at_level(logging.INFO, logger="kvwarm"):
        whole = client.messages.create(**kw)
    assert whole._request_id and whole._request_id.startswith("req-")
    assert any(whole._request_id in r.getMessage() for r in caplog.records)  # the logs' id
    with client.messages.stream(**kw) as stream:
        stream.get_final_message()
        assert stream.request_id and stream.request_id != whole._request_id
    assert client.messages.count_tokens(**{k: kw[k] for k in ("model", "messages")})._request_id
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(**{**kw, "messages": []})
    assert refused.value.request_id
    chat = server.openai().chat.completions.create(model="m", messages=kw["messages"], max_tokens=2)
    assert chat._request_id
    with pytest.raises(openai.BadRequestError) as refused_chat:
        server.openai().chat.completions.create(model="m", messages=[], max_tokens=2)
    assert refused_chat.value.request_id
    r = httpx.post(server.url + "/v1/messages", json=kw)
    assert "x-request-id" not in r.headers and r.headers["request-id"]


def test_search_results_are_read_as_text(server):
    """A search_result block (Anthropic's RAG input) was a 400, in a user turn and in
    a tool result both."""
    result = {
        "type": "search_result",
        "source": "https://example.com/a",
        "title": "Capitals",
        "content": [{"type": "text", "text": "Paris is"}, {"type": "text", "text": "the one."}],
        "citations": {"enabled": True},
    }
    read = "Capitals\nhttps://example.com/a\nParis is\nthe one."
    messages = [
        {"role": "user", "content": [result, {"type": "text", "text": "which?"}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [result]}],
        },
    ]
    server.anthropic().messages.create(
        model="c", max_tokens=2, messages=messages, tools=ANTHROPIC_TOOLS
    )
    seen = server.formatter.last_messages
    assert seen[0] == {"role": "user", "content": read + "\nwhich?"}
    assert seen[2] == {"role": "tool", "tool_call_id": "t1", "content": read}


def test_a_dead_engine_is_not_retried_by_the_sdk_but_loading_is():
    """The engine gone for good was a 503 overloaded_error, which the SDK (and Claude
    Code) retried on and on; loading and draining stay 503s worth retrying."""
    from app.errors import from_admission
    from scheduler.admission import EngineUnavailable

    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, eos_after=2))
    sent: list[object] = []
    http_client = anthropic.DefaultHttpxClient(event_hooks={"request": [sent.append]})
    kw = dict(model="c", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    with serve_app(app) as url:
        client = anthropic.Anthropic(
            base_url=url, api_key="x", max_retries=2, http_client=http_client
        )
        client.messages.create(**kw)
        app.state.kvwarm.engine.inject_fault(RuntimeError("GPU fell over"))
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.02)  # the engine thread dies at its next step
        with pytest.raises(anthropic.APIStatusError) as refused:
            client.messages.create(**kw)
    assert refused.value.status_code == 503
    assert refused.value.body["error"]["type"] == "overloaded_error"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert len(sent) == 2  # one each: no retries
    for retryable in (EngineUnavailable.loading(), EngineUnavailable.shutting_down()):
        assert "x-should-retry" not in (from_admission(retryable).headers or {})


def test_a_reply_the_watchdog_cut_is_max_tokens_even_when_the_limit_was_lowered():
    """A --request-timeout cut ends as length too: with a max_tokens lowered to fit the
    context it read model_context_window_exceeded, which sends a client to compact a
    context that was never full."""
    from app.anthropic_messages import stop_reason
    from app.generation import Outcome
    from scheduler.request import FinishReason

    cut = Outcome(finish_reason=FinishReason.LENGTH, timed_out=True)
    assert stop_reason(cut, limit_lowered=True) == "max_tokens"
    full = Outcome(finish_reason=FinishReason.LENGTH)
    assert stop_reason(full, limit_lowered=True) == "model_context_window_exceeded"
