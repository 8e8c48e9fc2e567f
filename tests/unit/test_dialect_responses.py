"""OpenAI Responses over a real socket, parsed by the official openai SDK."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response

from tests.helpers.dialects import PROMPTS, RESPONSES_TOOLS
from tests.helpers.http_server import serve_app


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
    # "<think>", "Need the ", "weather.</thi", "nk>\n\n": one token each
    assert first.usage.output_tokens_details.reasoning_tokens == 4
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
    # as OpenAI answers it: a 400 naming the field (an unknown stored response is a 404)
    with pytest.raises(openai.BadRequestError) as gone:
        client.responses.create(model="m", previous_response_id=first.id, input="again")
    error = gone.value.body
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "previous_response_not_found",
        "previous_response_id",
    )
    assert first.id in error["message"]


def test_a_response_validates_against_the_sdks_own_model(server):
    """The SDK parses leniently; its model says which fields a client may rely on
    (input_tokens_details.cache_write_tokens was missing)."""
    raw = server.openai().responses.with_raw_response.create(model="m", input="CALL_TOOL")
    Response.model_validate(json.loads(raw.text))


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


def test_responses_incomplete_message_status_agrees_streamed_and_final(server):
    events = list(
        server.openai().responses.create(model="m", input="hi", max_output_tokens=2, stream=True)
    )
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[-1].item.status == "incomplete"
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[-1].status == "incomplete"


def test_an_image_a_text_model_refuses_names_the_clients_own_field(server):
    """The index was the translated conversation's (instructions come first) under
    chat's field name: messages.1.content for input[0]."""
    import httpx

    r = httpx.post(
        server.url + "/v1/responses",
        json={
            "instructions": "sys",
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}],
                }
            ],
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_reasoning_before_a_call_stays_on_the_calls_turn(server):
    """It waited for the next assistant message and rode on a later step."""
    items = [
        {"role": "user", "content": "fix it"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look."}],
        },
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "R2"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Fixed."}],
        },
        {"role": "user", "content": "thanks"},
    ]
    server.openai().responses.create(model="m", input=items, store=False, tools=RESPONSES_TOOLS)
    seen = server.formatter.last_messages
    assert seen[1]["reasoning_content"] == "R2" and seen[1]["tool_calls"]
    assert "reasoning_content" not in seen[3]


def test_a_turn_that_was_reasoning_alone_keeps_it(server):
    """Thinking, then EOS: its reasoning waited for the next assistant message and
    the model read one turn's thought on another's answer."""
    items = [
        {"role": "user", "content": "q1"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "T1"}]},
        {"role": "user", "content": "q2"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "a2"}],
        },
        {"role": "user", "content": "q3"},
    ]
    server.openai().responses.create(model="m", input=items, store=False)
    seen = server.formatter.last_messages
    assert [m["role"] for m in seen] == ["user", "assistant", "user", "assistant", "user"]
    assert seen[1]["reasoning_content"] == "T1" and seen[1]["content"] == ""
    assert "reasoning_content" not in seen[3]


def test_a_response_echoes_tools_and_metadata_within_bounds_the_sdk_validates(server):
    """Built-in tools and extra keys are never rendered nor counted against the
    context, yet were copied into every response event on the event loop (a
    16 MiB body made each streamed event a 0.4 s stall for every client): extra
    keys are dropped, built-in tools bounded and echoed whole, metadata held to
    OpenAI's limits."""
    import httpx

    built_in = [
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "web_search_preview", "user_location": {"type": "approximate", "city": "Oslo"}},
    ]
    body = {
        "model": "m",
        "input": "hello",
        "tools": [*built_in, {**RESPONSES_TOOLS[0], "x_vendor": "x" * 100_000}],
        "metadata": {"ticket": "T-1", "use_kv_cache": False},
    }
    r = httpx.post(server.url + "/v1/responses", json=body)
    assert r.status_code == 200, r.text
    echoed = r.json()
    assert echoed["tools"] == [*built_in, RESPONSES_TOOLS[0]]
    assert echoed["metadata"] == {"ticket": "T-1"}  # kvwarm's own switches are not echoed
    Response.model_validate(echoed)  # strictly, as a client validating its replies does
    bulky = {**body, "tools": [{"type": "web_search_preview", "x": "x" * 100_000}]}
    r = httpx.post(server.url + "/v1/responses", json=bulky)
    assert r.status_code == 400 and "built-in tools" in r.text
    for metadata in (
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {"k": 5},
    ):
        r = httpx.post(server.url + "/v1/responses", json={**body, "metadata": metadata})
        assert r.status_code == 400 and "metadata" in r.text, (metadata, r.text)


def test_tool_choice_and_reasoning_echo_their_own_fields_only(server):
    """Extra keys of tool_choice and reasoning, and an unbounded summary, were
    echoed whole: 25 MiB sent once came back in every event of the stream."""
    import httpx

    body = {
        "model": "m",
        "input": "hello",
        "tools": RESPONSES_TOOLS,
        "tool_choice": {"type": "function", "name": "get_weather", "pad": "x" * 100_000},
        "reasoning": {"summary": "auto", "pad": "x" * 100_000},
    }
    r = httpx.post(server.url + "/v1/responses", json=body)
    assert r.status_code == 200, r.text
    echoed = r.json()
    assert echoed["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert echoed["reasoning"] == {"effort": None, "summary": "auto"}
    assert len(r.content) < 10_000
    for field, value in (
        ("reasoning", {"summary": "x" * 100_000}),
        ("tool_choice", {"type": "x" * 100_000}),
        ("previous_response_id", "resp_" + "x" * 100_000),
        ("reasoning", {"effort": "x" * 100_000}),  # refused, quoting a little of it
    ):
        r = httpx.post(server.url + "/v1/responses", json={**body, field: value})
        assert r.status_code == 400 and len(r.content) < 2_000, (field, len(r.content))
        assert r.json()["error"]["param"].startswith(field)


@pytest.mark.parametrize("role", ["assistant", "system", "developer"])
def test_an_image_outside_a_users_message_is_refused_as_in_chat(server, role):
    """Responses read images in any role's message (chat and Messages refuse them
    outside a user's): a system message's screenshot reached the prompt."""
    import httpx

    kind = "output_text" if role == "assistant" else "input_text"
    items = [
        {"role": "user", "content": "q"},
        {
            "type": "message",
            "role": role,
            "content": [
                {"type": kind, "text": "see"},
                {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
            ],
        },
        {"role": "user", "content": "q2"},
    ]
    r = httpx.post(server.url + "/v1/responses", json={"model": "m", "input": items})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.1", r.text


def test_a_text_part_without_its_text_is_refused_not_read_as_empty(server):
    import httpx

    items = [{"role": "user", "content": [{"type": "input_text"}]}]
    r = httpx.post(server.url + "/v1/responses", json={"model": "m", "input": items})
    assert r.status_code == 400 and "text" in r.json()["error"]["message"], r.text


def test_non_json_numbers_in_call_arguments_stay_text_and_the_response_is_stored(server):
    """json.loads reads NaN and Infinity: kept as numbers, they failed the stored
    conversation's dump, and the response a 200 had named was never found."""
    import httpx

    items = [
        {"role": "user", "content": "q"},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"x": NaN}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    body = {"model": "m", "input": items, "tools": RESPONSES_TOOLS}
    r = httpx.post(server.url + "/v1/responses", json=body)
    assert r.status_code == 200, r.text
    call = server.formatter.last_messages[1]["tool_calls"][0]["function"]
    assert call["arguments"] == '{"x": NaN}'  # the client's text, as sent
    stored = httpx.get(server.url + f"/v1/responses/{r.json()['id']}")
    assert stored.status_code == 200, stored.text
    follow = {"model": "m", "input": "more", "previous_response_id": r.json()["id"]}
    assert httpx.post(server.url + "/v1/responses", json=follow).status_code == 200


def test_reasoning_items_without_text_add_no_reasoning():
    """Codex sends reasoning items with an empty summary (encrypted content only):
    joined whole they made reasoning of bare newlines the template rendered."""
    from app.openai_responses import input_messages
    from app.responses_schemas import ResponsesRequest

    empty = {"type": "reasoning", "id": "rs_0", "summary": [], "encrypted_content": "x"}
    said = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "R"}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    items = [{"role": "user", "content": "q"}, empty, said, call, empty, call | {"call_id": "c2"}]
    parsed = ResponsesRequest.model_validate({"input": items}).input
    messages = input_messages(parsed)
    assert messages[1]["reasoning_content"] == "R" and len(messages[1]["tool_calls"]) == 2
    alone = ResponsesRequest.model_validate({"input": [items[0], empty, items[0]]}).input
    assert "reasoning_content" not in input_messages(alone)[1]


def test_reasoning_before_many_calls_is_gathered_in_linear_time():
    """Each call after a thought re-joined its turn's reasoning so far: 16 MB of
    thoughts and calls took 24 s of a preparation slot."""
    import time

    from app.openai_responses import input_messages
    from app.responses_schemas import ResponsesRequest

    pairs = 4_000
    thought = "t" * 4_000
    items = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}
    ]
    for i in range(pairs):
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{i}",
                "summary": [{"type": "summary_text", "text": thought}],
            }
        )
        items.append({"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"})
    parsed = ResponsesRequest.model_validate({"input": items}).input
    began = time.perf_counter()
    (message,) = input_messages(parsed)
    assert time.perf_counter() - began < 5  # a tenth of a second now
    assert len(message["tool_calls"]) == pairs
    assert message["reasoning_content"] == "\n".join([thought] * pairs)


def test_metadata_values_spelled_as_strings_are_read_as_the_values_they_spell():
    """OpenAI's metadata holds strings only (the SDK's type says so): kvwarm's
    numeric and switch fields there came as "42" and were refused as not numbers."""
    import httpx

    from tests.unit.test_http_api import make_app

    seen = []
    with serve_app(make_app(eos_after=2, script=seen.append)) as url:
        spelled = {"seed": "42", "temperature": "0.5", "top_k": "7", "use_kv_cache": "false"}
        r = httpx.post(url + "/v1/responses", json={"input": "hi", "metadata": spelled})
        assert r.status_code == 200, r.text
        assert r.json()["metadata"] == {}  # kvwarm's own fields, not the client's record
        bad = httpx.post(url + "/v1/responses", json={"input": "hi", "metadata": {"top_k": "x"}})
        assert bad.status_code == 400 and "metadata.top_k" in bad.text
    sampling = seen[0].sampling
    assert (sampling.seed, sampling.temperature, sampling.top_k) == (42, 0.5, 7)
    assert seen[0].cache is None


def test_tool_choice_objects_the_agents_sdk_sends(server):
    """allowed_tools narrows the callable tools to its list under its mode; a
    hosted tool's choice (file_search, web_search_preview, mcp, custom: tools kvwarm
    ignores) is auto, said in the ignored-fields header. All were refused with 400."""
    import httpx

    url = server.url + "/v1/responses"
    tools = [*RESPONSES_TOOLS, {**RESPONSES_TOOLS[0], "name": "get_time"}]
    allowed = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_time"}],
    }
    r = httpx.post(url, json={"input": "hi", "tools": tools, "tool_choice": allowed})
    assert r.status_code == 200, r.text
    assert r.json()["tool_choice"] == allowed
    for hosted in ({"type": "file_search"}, {"type": "mcp", "server_label": "x"}):
        r = httpx.post(url, json={"input": "hi", "tools": tools, "tool_choice": hosted})
        assert r.status_code == 200, r.text
        assert "tool_choice" in r.headers["x-kvwarm-ignored-fields"]
    for bad in (
        {"type": "allowed_tools", "mode": "sometimes", "tools": []},
        {"type": "allowed_tools", "mode": "auto", "tools": "get_time"},
        {"type": "functions", "name": "get_time"},  # a typo is no hosted tool
    ):
        r = httpx.post(url, json={"input": "hi", "tools": tools, "tool_choice": bad})
        assert r.status_code == 400 and "tool_choice" in r.text, r.text


def test_allowed_tools_show_and_allow_only_the_listed_tools(server):
    """Without constrained decoding, a model shown a tool it may not call calls it
    (its markup then leaked into the text): only the allowed tools are rendered, a
    call to any other stays text, and a required choice of one tool forces it."""
    import httpx

    url = server.url + "/v1/responses"
    tools = [*RESPONSES_TOOLS, {**RESPONSES_TOOLS[0], "name": "get_time"}]

    def allowed(mode: str, *names: str) -> dict:
        listed = [{"type": "function", "name": n} for n in names]
        return {"type": "allowed_tools", "mode": mode, "tools": listed}

    shown = []
    for choice in (allowed("auto", "get_time"), allowed("auto", "get_weather", "get_time")):
        r = httpx.post(url, json={"input": "hi", "tools": tools, "tool_choice": choice})
        assert r.status_code == 200, r.text
        shown.append([t["function"]["name"] for t in server.formatter.last_kwargs["tools"]])
    assert shown == [["get_time"], ["get_weather", "get_time"]]
    # the model calls get_weather, which this turn neither shows nor allows: text
    r = httpx.post(
        url, json={"input": "SANDWICH", "tools": tools, "tool_choice": allowed("auto", "get_time")}
    )
    out = r.json()["output"]
    assert [i["type"] for i in out] == ["message"] and "get_weather" in out[0]["content"][0]["text"]
    r = httpx.post(
        url,
        json={"input": "SANDWICH", "tools": tools, "tool_choice": allowed("auto", "get_weather")},
    )
    assert [i["name"] for i in r.json()["output"] if i["type"] == "function_call"] == [
        "get_weather"
    ]
    # required over one allowed tool forces that very tool
    r = httpx.post(
        url, json={"input": "FORCE", "tools": tools, "tool_choice": allowed("required", "get_time")}
    )
    calls = [
        (i["name"], i["arguments"]) for i in r.json()["output"] if i["type"] == "function_call"
    ]
    assert calls == [("get_time", '{"city": "Oslo"}')]
    assert PROMPTS[-1].endswith('<tool_call>\n{"name": "get_time", "arguments": ')


def test_a_failed_response_over_the_context_says_context_length_exceeded():
    """Codex reads a failed response's ``context_length_exceeded`` as "the context
    window is full" (compact and go on); ``invalid_prompt`` it retried five times."""
    from app.generation import Outcome
    from app.openai_responses import _finalise, _Items
    from scheduler.request import FinishReason

    # the budget shrank while it was queued: what fails a request after its headers
    done = Outcome(finish_reason=FinishReason.ERROR, error="over", error_code="context_over_budget")
    response = _finalise({}, done, _Items())
    assert response["status"] == "failed"
    assert response["error"]["code"] == "context_length_exceeded"


def test_text_keys_sent_as_null_are_not_reported_as_ignored():
    """A key of ``text`` (or of its format) sent as null asks for nothing, as a
    top-level field sent so: it was still named in X-Kvwarm-Ignored-Fields."""
    from app.responses_schemas import TextConfig

    sent = {"format": {"type": "text", "foo": None}, "foo": None, "verbosity": None}
    assert TextConfig.model_validate(sent).ignored() == ()
    sent = {"format": {"type": "text", "foo": 1}, "foo": None, "bar": {}}
    assert TextConfig.model_validate(sent).ignored() == ("text.bar", "text.format.foo")
