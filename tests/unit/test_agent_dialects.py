"""The three agent dialects over a real socket, parsed by the official SDKs.

A model-free engine plays scripted replies (reasoning, text and tool-call markup
split at awkward places) through the real output pipeline, so every tool path
is exercised without a model that happens to call tools.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine, prompt_text
from tests.helpers.http_server import serve_app

QWEN_CALL = [
    "<think>",
    "Need the ",
    "weather.</thi",
    "nk>\n\n",
    "Checking.\n<tool",
    "_call>\n<function=get_weather>\n<parameter=city>\nPar",
    "is\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
]
THINK_ANSWER = ["<think>pl", "an</think>", "\n\nAnswer ", "done."]
FORCED_REST = ['{"city": "Os', 'lo"}}', "\n</tool_call>"]  # after a forced Hermes opening
TEXT_CALL_TEXT = [
    "Before.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "After.",
]
SCRIPTS = {
    "CALL_TOOL": QWEN_CALL,
    "THINK": THINK_ANSWER,
    "FORCE": FORCED_REST,
    "SANDWICH": TEXT_CALL_TEXT,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": "w", "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


PROMPTS: list[str] = []  # what the engine was asked to continue, newest last


def scripted(req):
    text = prompt_text(req)
    PROMPTS.append(text)
    last = text[text.rfind("<user>") :]
    return next((pieces for word, pieces in SCRIPTS.items() if word in last), None)


class Served:
    def __init__(self, url: str, app):
        self.url = url
        self.app = app

    @property
    def formatter(self):
        return self.app.state.kvwarm.engine.info.formatter

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="k", max_retries=0)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="k", max_retries=0)


def _serve(**settings):
    app = create_app(
        Settings(_env_file=None, **settings),
        lambda s, r: FakeEngine(s, r, script=scripted, eos_after=6),
    )
    return app


@pytest.fixture(scope="module")
def server():
    app = _serve()
    with serve_app(app) as url:
        yield Served(url, app)


# -- chat completions -----------------------------------------------------------
def test_chat_tool_call_non_streaming(server):
    r = server.openai().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "CALL_TOOL please"}], tools=TOOLS
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}


def test_chat_streaming_matches_non_streaming_byte_for_byte(server):
    client = server.openai()
    kwargs = dict(model="m", messages=[{"role": "user", "content": "CALL_TOOL"}], tools=TOOLS)
    whole = client.chat.completions.create(**kwargs).choices[0]
    reasoning, content, calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        assert "<" not in (delta.content or "") + (
            (delta.model_extra or {}).get("reasoning_content") or ""
        )
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == whole.message.model_extra["reasoning_content"]
    assert content == whole.message.content
    assert finish == "tool_calls"
    (call,) = calls
    assert call.index == 0 and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}


def test_tool_round_trip_renders_calls_results_and_the_original_reply(server):
    client = server.openai()
    first = (
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "CALL_TOOL"}], tools=TOOLS
        )
        .choices[0]
        .message
    )
    echo = {
        "role": "assistant",
        "content": first.content,
        "tool_calls": [c.model_dump() for c in first.tool_calls],
    }
    result = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"}
    client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "CALL_TOOL"}, echo, result],
        tools=TOOLS,
    )
    seen = server.formatter.last_messages
    assistant = seen[1]
    # healed: the model reads its own reasoning back, the client's call ids stay
    assert assistant["content"] == "<think>Need the weather.</think>\n\nChecking.\n"
    assert assistant["tool_calls"][0]["id"] == first.tool_calls[0].id
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 3}
    assert seen[2] == {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"}
    assert server.formatter.last_kwargs["tools"] == TOOLS


def test_tool_choice_none_and_named(server):
    client = server.openai()
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "CALL_TOOL"}],
        tools=TOOLS,
        tool_choice="none",
    )
    # still shown (the tools block stays in the cached prefix), but nothing is parsed
    assert server.formatter.last_kwargs["tools"] == TOOLS
    assert r.choices[0].message.tool_calls is None
    assert "<tool_call>" in r.choices[0].message.content  # not parsed: plain text
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "CALL_TOOL"}],
        tools=TOOLS,
        tool_choice=named,
    )
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_starts_the_reply_inside_the_call(server, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(
        model="m", messages=[{"role": "user", "content": "FORCE"}], tools=TOOLS, tool_choice=named
    )
    client = server.openai()
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
    else:
        message = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = message.message.tool_calls, message.finish_reason
    assert finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    # the model continues from inside the call the prompt opened for it
    assert PROMPTS[-1].endswith('<assistant><tool_call>\n{"name": "get_weather", "arguments": ')


def test_forced_openings_follow_the_family():
    from app.protocol.tool_formats import forced_opening

    assert forced_opening("qwen3_coder", "f").text == "<tool_call>\n<function=f>\n"
    assert forced_opening("glm47", None).text == "<tool_call>"
    assert forced_opening("mistral", "f").text == "[TOOL_CALLS]f[ARGS]"
    assert forced_opening("gemma4", "f").text == "<|tool_call>call:f{"
    assert forced_opening(None, None).text == '<tool_call>\n{"name": "'


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, True),
        ({"reasoning_effort": "none"}, False),
        ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, False),
        ({"extra_body": {"thinking": {"type": "disabled"}}}, False),
        ({"metadata": {"enable_thinking": "false"}}, False),
    ],
)
def test_thinking_controls_reach_the_template(server, extra, expected):
    server.openai().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1, **extra
    )
    assert server.formatter.last_kwargs["enable_thinking"] is expected


def test_server_thinking_default_and_strip_thinking():
    app = _serve(thinking="off", strip_thinking=True)
    with serve_app(app) as url:
        served = Served(url, app)
        r = served.openai().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "THINK"}]
        )
        assert served.formatter.last_kwargs["enable_thinking"] is False
        message = r.choices[0].message
        assert message.content == "Answer done."
        assert "reasoning_content" not in (message.model_extra or {})


# -- Anthropic Messages ---------------------------------------------------------
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


# -- OpenAI Responses -----------------------------------------------------------
def test_responses_items_and_previous_response_id(server):
    client = server.openai()
    first = client.responses.create(
        model="m", input="CALL_TOOL", tools=RESPONSES_TOOLS, instructions="Be brief."
    )
    assert [item.type for item in first.output] == ["reasoning", "message", "function_call"]
    assert first.output_text == "Checking.\n"
    call = first.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
    assert first.status == "completed"
    assert first.usage.input_tokens > 0
    second = client.responses.create(
        model="m",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=RESPONSES_TOOLS,
    )
    seen = server.formatter.last_messages
    # the stored turn comes back as the model wrote it; instructions are not carried over
    assert seen[0] == {"role": "user", "content": "CALL_TOOL"}
    assert seen[1]["content"] == "<think>Need the weather.</think>\n\nChecking.\n"
    assert seen[1]["tool_calls"][0]["id"] == call.call_id
    assert seen[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", previous_response_id=first.id, input="again")


def test_responses_stream_event_chain(server):
    client = server.openai()
    events = list(
        client.responses.create(model="m", input="CALL_TOOL", tools=RESPONSES_TOOLS, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for expected in (
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ):
        assert expected in kinds, expected
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert (
        kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    )
    final = events[-1].response
    whole = client.responses.create(model="m", input="CALL_TOOL", tools=RESPONSES_TOOLS)
    assert final.output_text == whole.output_text
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed_text == whole.output_text


def test_responses_incomplete_and_not_stored(server):
    client = server.openai()
    r = client.responses.create(model="m", input="hi", max_output_tokens=2, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


# -- legacy completions -----------------------------------------------------------
def test_legacy_completions(server):
    client = server.openai()
    r = client.completions.create(model="m", prompt="Once upon", max_tokens=3)
    assert r.object == "text_completion"
    assert r.choices[0].text == "w0 w1 w2 " and r.choices[0].finish_reason == "length"
    tokens = client.completions.create(model="m", prompt=[72, 105], max_tokens=2)
    assert tokens.usage.prompt_tokens == 2
    echoed = client.completions.create(model="m", prompt="Echo: ", max_tokens=1, echo=True)
    assert echoed.choices[0].text == "Echo: w0 "
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="m", prompt="Once upon", max_tokens=3, stream=True)
        if c.choices
    )
    assert streamed == r.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x", max_tokens=2, logprobs=2)


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


def test_anthropic_images_in_tool_results_become_a_note(server):
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
                    "content": [image, {"type": "text", "text": "ok"}],
                }
            ],
        },
    ]
    server.anthropic().messages.create(
        model="c", max_tokens=4, messages=history, tools=ANTHROPIC_TOOLS
    )
    tool = server.formatter.last_messages[-1]
    assert tool["role"] == "tool" and tool["content"].startswith("[image omitted")


def test_preserve_thinking_is_passed_to_templates_that_read_it():
    import dataclasses

    from engine.text_syntax import probe_syntax
    from scheduler.contracts import TextSyntax

    class Tok:  # what an mlx-lm TokenizerWrapper exposes
        think_start, think_end = "<think>", "</think>"
        chat_template = "{% if preserve_thinking %}{{ reasoning }}{% endif %}{{ enable_thinking }}"

        @staticmethod
        def tool_parser(text, tools=None):
            return None

    Tok.tool_parser.__module__ = "mlx_lm.tool_parsers.qwen3_coder"
    probed = probe_syntax(Tok())
    assert probed == TextSyntax(
        "<think>",
        "</think>",
        "qwen3_coder",
        tool_call_start=None,  # the stub has no markup attributes
        template_vars=frozenset({"preserve_thinking", "enable_thinking"}),
    )
    app = _serve()
    with serve_app(app) as url:
        engine = app.state.kvwarm.engine
        engine.info = dataclasses.replace(engine.info, syntax=probed)
        served = Served(url, app)
        served.openai().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
        assert served.formatter.last_kwargs["preserve_thinking"] is True


def test_output_order_is_the_same_streamed_and_not(server):
    client = server.anthropic()
    kwargs = dict(
        model="c",
        max_tokens=64,
        messages=[{"role": "user", "content": "SANDWICH"}],
        tools=ANTHROPIC_TOOLS,
    )
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in whole.content] == ["text", "tool_use", "text"]
    assert [b.type for b in streamed.content] == ["text", "tool_use", "text"]
    assert whole.content[2].text == streamed.content[2].text == "After."
    r = server.openai().responses.create(model="m", input="SANDWICH", tools=RESPONSES_TOOLS)
    assert [i.type for i in r.output] == ["message", "function_call", "message"]


def test_codex_style_responses_input_renders_like_chat(server):
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "look"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [
                {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
                {"type": "input_text", "text": "done"},
            ],
        },
    ]
    server.openai().responses.create(
        model="m",
        input=items,
        store=False,
        include=["reasoning.encrypted_content"],
        tools=RESPONSES_TOOLS,
    )
    seen = server.formatter.last_messages
    assert seen[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Oslo"},
    }
    assert seen[2] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": "[image omitted: this model cannot read images]\ndone",
    }


def test_bad_inputs_are_400s_not_500s(server):
    r = httpx.post(
        server.url + "/v1/messages",
        json={"model": "c", "max_tokens": 4, "messages": [{"role": "user", "content": []}]},
    )
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "seed": "x"})
    assert r.status_code == 400, r.text
    r = httpx.post(
        server.url + "/v1/responses", json={"input": [{"role": "user", "content": [42]}]}
    )
    assert r.status_code == 400, r.text
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": "x"},
        },
    )
    assert r.status_code == 400, r.text


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


def test_slow_streams_carry_keep_alives(monkeypatch):
    import app.openai_chat

    monkeypatch.setattr(app.openai_chat, "KEEPALIVE_S", 0.05)
    app_ = create_app(
        Settings(_env_file=None), lambda s, r: FakeEngine(s, r, step_delay=0.3, eos_after=2)
    )
    with serve_app(app_) as url:
        body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as resp:
            raw = "".join(resp.iter_text())
        assert ": keep-alive" in raw
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="m", messages=body["messages"], stream=True
            )
            if c.choices
        )
        assert text == "w0 w1 "


def test_responses_incomplete_message_status_agrees_streamed_and_final(server):
    events = list(
        server.openai().responses.create(model="m", input="hi", max_output_tokens=2, stream=True)
    )
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[-1].item.status == "incomplete"
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[-1].status == "incomplete"


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
