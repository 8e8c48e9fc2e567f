"""Responses conformance: what the server sends, validated by the openai SDK's own types."""

from __future__ import annotations

import json

import httpx
import pytest
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


def test_custom_tool_items_render_as_function_calls_and_their_results(server):
    """A Codex history holding apply_patch calls (custom tools) was a 400: the
    call renders as a tool call whose arguments are its input text."""
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    items = [
        {"role": "user", "content": "patch it"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": patch},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done."},
    ]
    r = httpx.post(server.url + "/v1/responses", json={"input": items, "store": False})
    assert r.status_code == 200, r.text
    seen = server.formatter.last_messages
    assert seen[1]["role"] == "assistant"
    assert seen[1]["tool_calls"][0]["id"] == "c1"
    assert seen[1]["tool_calls"][0]["function"] == {"name": "apply_patch", "arguments": patch}
    assert seen[2] == {"role": "tool", "tool_call_id": "c1", "content": "Done."}
    missing = [items[0], {**items[1], "input": None}]
    r = httpx.post(server.url + "/v1/responses", json={"input": missing})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("input.1"), r.text


def test_hosted_tool_items_are_skipped_and_reported(server):
    items = [
        {"role": "user", "content": "list files"},
        {
            "type": "local_shell_call",
            "id": "ls_1",
            "call_id": "s1",
            "status": "completed",
            "action": {"type": "exec", "command": ["ls"], "env": {}},
        },
        {"type": "local_shell_call_output", "id": "s1", "output": "a.txt"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"role": "user", "content": "and now?"},
    ]
    r = httpx.post(server.url + "/v1/responses", json={"input": items, "store": False})
    assert r.status_code == 200, r.text
    ignored = r.headers["x-kvwarm-ignored-fields"].split(", ")
    assert ignored == [
        "input.local_shell_call",
        "input.local_shell_call_output",
        "input.web_search_call",
    ]
    seen = server.formatter.last_messages
    assert [m["content"] for m in seen] == ["list files", "and now?"]


def test_an_item_reference_reads_the_stored_item_and_an_unknown_one_is_a_400(server):
    from tests.helpers.dialects import RESPONSES_TOOLS

    client = server.openai()
    first = client.responses.create(
        model="m",
        input=[{"role": "user", "content": "CALL_TOOL"}],
        tools=RESPONSES_TOOLS,
    )
    call = first.output[2]
    (mine,) = client.responses.input_items.list(first.id)  # its id, made by the server
    items = [
        {"type": "item_reference", "id": mine.id},  # an input item of a stored response
        {"type": "item_reference", "id": call.id},  # and an output item
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    body = {"input": items, "tools": RESPONSES_TOOLS, "store": False}
    r = httpx.post(server.url + "/v1/responses", json=body)
    assert r.status_code == 200, r.text
    seen = server.formatter.last_messages
    assert seen[0] == {"role": "user", "content": "CALL_TOOL"}
    assert seen[1]["tool_calls"][0]["id"] == call.call_id
    assert seen[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 3}
    assert seen[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
    unknown = [items[0], {"type": "item_reference", "id": "msg_nope"}]
    r = httpx.post(server.url + "/v1/responses", json={"input": unknown})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input.1" and "msg_nope" in r.json()["error"]["message"]
    client.responses.delete(first.id)  # its items go with it
    r = httpx.post(server.url + "/v1/responses", json={"input": items[:1], "store": False})
    assert r.status_code == 400 and mine.id in r.text


def test_a_stored_responses_items_are_found_by_id_until_it_goes():
    from app.response_store import ResponseStore

    store = ResponseStore()
    items = [{"type": "message", "id": "msg_in", "role": "user", "content": []}]
    items.append({"type": "message", "id": "msg_client", "role": "user", "content": "y"})
    response = {"id": "r1", "output": [{"type": "message", "id": "msg_out"}]}
    store.put(response, [{"role": "user", "content": "x"}], items, minted={"msg_in"})
    stored = store.holding("msg_out")
    assert stored is store.get("r1") and stored.item("msg_out") == response["output"][0]
    assert store.holding("msg_in").item("msg_in") == items[0]
    assert store.holding("msg_client") is None  # a client's id: listed, never indexed
    assert stored.conversation() == [{"role": "user", "content": "x"}]
    assert store.nbytes == stored.nbytes
    store.delete("r1")
    assert store.holding("msg_in") is None and store.nbytes == 0 and not store._owners  # noqa: SLF001


def test_input_may_be_left_out_when_continuing_a_stored_response(server):
    """The SDK's input is optional (a turn continued from previous_response_id
    alone): it was a 400 'input: Field required'."""
    client = server.openai()
    first = client.responses.create(model="m", input="THINK")
    again = client.responses.create(model="m", previous_response_id=first.id)
    assert again.status == "completed" and again.previous_response_id == first.id
    seen = server.formatter.last_messages
    assert [m["role"] for m in seen] == ["user", "assistant"] and seen[0]["content"] == "THINK"
    r = httpx.post(server.url + "/v1/responses", json={"model": "m"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_a_reply_cut_by_the_request_timeout_says_so_and_is_not_stored():
    """The watchdog's cut read as max_output_tokens (the client's own limit) and
    was stored to continue from. Chat delivers what was generated (finish length)
    and keeps nothing: so here, in a failed response naming the timeout."""
    settings = Settings(_env_file=None, request_timeout=1.0)
    app = create_app(settings, lambda s, r: FakeEngine(s, r, step_delay=0.2))
    with serve_app(app) as url:
        body = {"input": "hi", "max_output_tokens": 500}
        r = httpx.post(url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 200, r.text
        cut = Response.model_validate(r.json())
        events = _events(url, body)
        assert httpx.get(url + f"/v1/responses/{cut.id}").status_code == 404
        streamed = events[-1]["response"]
        assert httpx.get(url + f"/v1/responses/{streamed['id']}").status_code == 404
    assert events[-1]["type"] == "response.failed"
    for response in (cut, Response.model_validate(streamed)):
        assert response.status == "failed" and response.incomplete_details is None
        assert response.error.code == "server_error" and "request timeout" in response.error.message
        assert response.output[-1].status == "incomplete" and response.output_text.startswith("w0 ")


def test_a_stored_responses_input_items_are_listed_as_openai_lists_them(server):
    from openai.types.responses import ResponseItem
    from openai.types.responses.response_item_list import ResponseItemList

    from tests.helpers.dialects import RESPONSES_TOOLS

    client = server.openai()
    items = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}], "id": "msg_q"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "x"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok"},
        {"role": "user", "content": "thanks", "x_vendor": "not listed"},
    ]
    created = client.responses.create(model="m", input=items, tools=RESPONSES_TOOLS)
    listed = list(client.responses.input_items.list(created.id, order="asc", limit=3))
    assert [i.type for i in listed] == [i.get("type", "message") for i in items]
    assert listed[1].id == "msg_q" and all(i.id for i in listed)
    assert listed[4].content[0].text == "It is sunny." and listed[5].input == "x"
    url = server.url + f"/v1/responses/{created.id}/input_items"
    page = httpx.get(url, params={"limit": 2}).json()  # newest first by default
    ResponseItemList.model_validate(page)
    for item in httpx.get(url, params={"limit": 100}).json()["data"]:
        TypeAdapter(ResponseItem).validate_python(item)
        assert "x_vendor" not in item
    assert [i["id"] for i in page["data"]] == [listed[-1].id, listed[-2].id]
    assert page["has_more"] and page["first_id"] == listed[-1].id
    assert page["last_id"] == listed[-2].id
    after = httpx.get(url, params={"after": page["last_id"], "limit": 100}).json()
    assert [i["id"] for i in after["data"]] == [i.id for i in reversed(listed[:-2])]
    assert not after["has_more"]
    text = client.responses.create(model="m", input="hello")
    (only,) = client.responses.input_items.list(text.id)
    assert only.role == "user" and only.content[0].text == "hello"
    for params in ({"limit": 0}, {"limit": 101}, {"order": "sideways"}):
        r = httpx.get(url, params=params)
        assert r.status_code == 400, (params, r.text)
    r = httpx.get(server.url + "/v1/responses/resp_nope/input_items")
    assert r.status_code == 404 and "resp_nope" in r.json()["error"]["message"]


def test_function_call_ids_are_unique_whatever_the_model_wrote():
    """As chat and Messages: two calls the model numbered "1" shared one call_id, and
    the client pairs each function_call_output with its call by it."""
    import openai

    pieces = [
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}, "id": "1"}}\n'
        "</tool_call>\n"
        for city in ("Rome", "Oslo")
    ]
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    app = create_app(
        Settings(_env_file=None), lambda s, r: FakeEngine(s, r, script=lambda req: pieces)
    )
    with serve_app(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        whole = client.responses.create(model="m", input="x", tools=tools, store=False)
        streamed = [
            event.item.call_id
            for event in client.responses.create(
                model="m", input="x", tools=tools, store=False, stream=True
            )
            if event.type == "response.output_item.done" and event.item.type == "function_call"
        ]
    calls = [i.call_id for i in whole.output if i.type == "function_call"]
    for ids in (calls, streamed):
        assert len(ids) == 2 and ids[0] == "1" and ids[1] != "1", ids


def _roomy(**settings):
    """The scripted server with context for long items (one token a character)."""
    from tests.helpers.dialects import scripted

    def engine(s, r):
        return FakeEngine(s, r, 150_000, 150_000, script=scripted, eos_after=6)

    return create_app(Settings(_env_file=None, **settings), engine)


def test_item_references_are_held_to_a_request_bodys_limits():
    """300 references in a 13 KB body to one stored 1 MiB item made 300 MiB of
    prompt: what the references name now counts against the body limits."""
    with serve_app(_roomy(max_body_bytes=200_000)) as url:
        first = httpx.post(url + "/v1/responses", json={"input": "x" * 20_000})
        assert first.status_code == 200, first.text
        listed = httpx.get(url + f"/v1/responses/{first.json()['id']}/input_items").json()
        refs = [{"type": "item_reference", "id": listed["data"][0]["id"]}] * 20  # 400 KB
        r = httpx.post(url + "/v1/responses", json={"input": refs, "store": False})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "item_references_too_large" and error["param"] == "input"
        r = httpx.post(url + "/v1/responses", json={"input": refs[:5], "store": False})
        assert r.status_code == 200, r.text


def test_references_to_a_responses_output_parse_it_once(monkeypatch):
    """Each reference to an output item parsed the whole response again: 1,000 of
    them to a response with 1 MiB of instructions held the GIL for 1.1 s."""
    from tests.helpers.dialects import RESPONSES_TOOLS

    with serve_app(_roomy()) as url:
        body = {"input": "CALL_TOOL", "tools": RESPONSES_TOOLS, "instructions": "i" * 50_000}
        first = httpx.post(url + "/v1/responses", json=body)
        assert first.status_code == 200, first.text
        call = first.json()["output"][-1]
        parses = []
        loads = json.loads

        def counted(text, *args, **kwargs):
            if len(text) > 50_000:
                parses.append(len(text))
            return loads(text, *args, **kwargs)

        monkeypatch.setattr(json, "loads", counted)
        items = [{"type": "item_reference", "id": call["id"]}] * 300
        items.append({"type": "function_call_output", "call_id": call["call_id"], "output": "ok"})
        body = {"input": items, "tools": RESPONSES_TOOLS, "store": False}
        r = httpx.post(url + "/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert len(parses) <= 1, parses


def test_a_history_sent_again_is_held_once():
    """Each input item without an id was stored under a new one, so a client sending
    its history again (store is on by default) stored it again every turn: a 1 MiB
    image added 1 MiB a turn. Items are held without their ids, shared as messages are."""
    app = _roomy()
    history = [{"role": "user", "content": "y" * 50_000}]
    with serve_app(app) as url:
        store = app.state.kvwarm.responses
        sizes, ids = [], []
        for _ in range(3):
            created = httpx.post(url + "/v1/responses", json={"input": history})
            assert created.status_code == 200, created.text
            sizes.append(store.nbytes)
            listing = f"/v1/responses/{created.json()['id']}/input_items"
            (item,) = httpx.get(url + listing).json()["data"]
            assert item["content"][0]["text"] == history[0]["content"]
            ids.append(item["id"])
        assert sizes[2] - sizes[1] < 10_000 and sizes[1] - sizes[0] < 10_000, sizes
        assert len(set(ids)) == 3  # each response's item keeps an id of its own
        refs = [{"type": "item_reference", "id": i} for i in ids]
        r = httpx.post(url + "/v1/responses", json={"input": refs[:1] + refs[2:], "store": False})
        assert r.status_code == 200, r.text
    seen = app.state.kvwarm.engine.info.formatter.last_messages
    assert [m["content"] for m in seen] == [history[0]["content"]] * 2


def test_ids_clients_chose_name_nothing_in_the_store(server):
    """Ids clients chose were indexed: clients A and B both sending msg_1 read each
    other's items, and deleting B's response orphaned A's. Only ids the server made
    (random, as a response's own) name a stored item."""
    from tests.helpers.dialects import RESPONSES_TOOLS

    client = server.openai()
    mine = [{"role": "user", "content": "CALL_TOOL", "id": "msg_1"}]
    first = client.responses.create(model="m", input=mine, tools=RESPONSES_TOOLS)
    client.responses.create(model="m", input=[{"role": "user", "content": "B", "id": "msg_1"}])
    assert [i.id for i in client.responses.input_items.list(first.id)] == ["msg_1"]  # as sent
    r = httpx.post(server.url + "/v1/responses", json={"input": [_ref("msg_1")], "store": False})
    assert r.status_code == 400 and r.json()["error"]["code"] == "item_not_found", r.text
    call = first.output[-1]
    sent_back = [  # the call the server made, sent back with its id, then deleted
        {k: v for k, v in call.model_dump().items() if k != "status"},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    again = client.responses.create(model="m", input=sent_back, tools=RESPONSES_TOOLS)
    client.responses.delete(again.id)
    items = [_ref(call.id), sent_back[1]]  # still found: in the response that made it
    body = {"input": items, "tools": RESPONSES_TOOLS, "store": False}
    r = httpx.post(server.url + "/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert server.formatter.last_messages[0]["tool_calls"][0]["id"] == call.call_id


def _ref(item_id: str) -> dict:
    return {"type": "item_reference", "id": item_id}


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_input_items_sent_under_one_id_twice_are_paged_through_once(server, order):
    """The cursor is an item's id: two items under one id (a client's own, or two
    references to one stored item) sent the page after the second back to the
    first, and a client following has_more paged forever. A repeated id is listed
    under an id of its own; its first item keeps the client's."""
    ids = ["m_x", "m_y", "m_z", "m_y", "m_w"]
    items = [{"role": "user", "content": c, "id": i} for c, i in zip("abcde", ids, strict=True)]
    created = httpx.post(server.url + "/v1/responses", json={"input": items})
    assert created.status_code == 200, created.text
    url = server.url + f"/v1/responses/{created.json()['id']}/input_items"
    seen, after = [], None
    for _ in range(len(items)):  # a page of two at a time: three pages, not more
        params = {"order": order, "limit": 2, **({"after": after} if after else {})}
        page = httpx.get(url, params=params).json()
        seen += page["data"]
        after = page["last_id"]
        if not page["has_more"]:
            break
    assert not page["has_more"]
    texts = [i["content"][0]["text"] for i in seen]
    assert texts == (list("abcde") if order == "asc" else list("edcba"))
    listed = {i["content"][0]["text"]: i["id"] for i in seen}
    assert [listed[t] for t in "abce"] == ["m_x", "m_y", "m_z", "m_w"]
    assert listed["d"].startswith("msg_") and len(set(listed.values())) == 5


@pytest.mark.parametrize("summary", ["auto", "detailed", None])
def test_a_reasoning_summary_asked_for_holds_the_reasoning(server, summary):
    """reasoning.summary was echoed but every reasoning item's summary was empty:
    clients that show summaries (Codex asks for "auto") showed nothing. Asked for,
    the summary is the reasoning's text, streamed in the summary events too."""
    body = {"input": "THINK", "reasoning": {"summary": summary}}
    whole = httpx.post(server.url + "/v1/responses", json=body).json()
    events = _events(server.url, body)  # each event validated by the SDK's types
    final = Response.model_validate(events[-1]["response"])
    wanted = [{"type": "summary_text", "text": "plan"}] if summary else []
    for reasoning in (whole["output"][0], final.output[0].model_dump(exclude_none=True)):
        assert reasoning["type"] == "reasoning" and reasoning["summary"] == wanted
        assert reasoning["content"] == [{"type": "reasoning_text", "text": "plan"}]
    kinds = [e["type"] for e in events]
    summaries = [e for e in events if e["type"].startswith("response.reasoning_summary")]
    if not summary:
        assert summaries == []
        return
    assert [e["type"] for e in summaries][0] == "response.reasoning_summary_part.added"
    assert [e["type"] for e in summaries][-2:] == [
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
    ]
    deltas = [e["delta"] for e in summaries if e["type"].endswith("text.delta")]
    assert "".join(deltas) == "plan" and summaries[-2]["text"] == "plan"
    assert summaries[-1]["part"] == wanted[0]
    assert {(e["item_id"], e["output_index"], e["summary_index"]) for e in summaries} == {
        (final.output[0].id, 0, 0)
    }
    # each within its item: after it is added, before it is done
    added = kinds.index("response.output_item.added")
    assert added < kinds.index("response.reasoning_summary_part.added")
    assert kinds.index("response.reasoning_summary_part.done") < kinds.index(
        "response.output_item.done"
    )
