"""HTTP contract over a real socket with a model-free engine: status codes,
error bodies, SSE framing, auth, limits, disconnects and engine death."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest

from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import serve_app

CHAT = "/v1/chat/completions"


def make_app(settings: Settings | None = None, **engine_kw):
    settings = settings or Settings(_env_file=None)
    return create_app(settings, lambda s, r: FakeEngine(s, r, **engine_kw))


def msgs(text="hi"):
    return [{"role": "user", "content": text}]


def assert_error(
    resp: httpx.Response, status: int, code: str | None = None, type_: str | None = None
):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["message"]
    if code:
        assert err["code"] == code
    if type_:
        assert err["type"] == type_
    return err


@pytest.fixture(scope="module")
def base():
    with serve_app(make_app(eos_after=5)) as url:
        yield url


def test_non_streaming_completion_shape(base):
    r = httpx.post(base + CHAT, json={"model": "gpt-4o", "messages": msgs(), "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "fake-model"  # whatever the client asked for
    choice = body["choices"][0]
    message = choice["message"]
    assert message == {
        "role": "assistant",
        "content": "w0 w1 w2 ",
        "message_id": message["message_id"],
    }
    assert message["message_id"].startswith("req-")
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_eos_finishes_with_stop(base):
    r = httpx.post(base + CHAT, json={"messages": msgs(), "max_tokens": 50})
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_max_completion_tokens_wins_over_max_tokens(base):
    r = httpx.post(
        base + CHAT, json={"messages": msgs(), "max_tokens": 1, "max_completion_tokens": 2}
    )
    assert r.json()["usage"]["completion_tokens"] == 2


def test_text_parts_and_all_roles_are_accepted(base):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert httpx.post(base + CHAT, json={"messages": messages, "max_tokens": 1}).status_code == 200


def sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_conv_headers_and_use_kv_cache_false(base):
    r = httpx.post(
        base + CHAT, json={"messages": msgs(), "max_tokens": 2, "conversation_id": "c-1"}
    )
    assert r.headers["x-conv-id"] == "c-1" and r.headers["x-conv-kv"] == "fresh"
    assert r.json()["choices"][0]["message"]["message_id"]
    r = httpx.post(
        base + CHAT,
        json={"messages": msgs(), "max_tokens": 2, "extra_body": {"use_kv_cache": False}},
    )
    assert r.status_code == 200 and r.headers["x-conv-kv"] == "disabled"
    r = httpx.post(base + CHAT, json={"messages": msgs(), "use_kv_cache": "no"})
    assert_error(r, 400, None)
    r = httpx.post(base + CHAT, json={"messages": msgs(), "extra_body": {"kv_bits": 5}})
    assert "kv_bits" in assert_error(r, 400, None)["param"]
    # every place a session id rides, in completions as in chat
    for where in ("extra_body", "metadata"):
        for path, body in ((CHAT, {"messages": msgs()}), ("/v1/completions", {"prompt": "x"})):
            r = httpx.post(
                base + path, json={**body, "max_tokens": 2, where: {"conversation_id": where}}
            )
            assert r.headers["x-conv-id"] == where, (path, where)


def test_completions_honour_use_kv_cache_and_kv_bits():
    """The legacy endpoint takes the cache fields chat takes (it accepted them
    and reused and stored the KV anyway, at the server's precision)."""
    seen = []

    def script(request):
        seen.append(request)

    with serve_app(make_app(eos_after=2, script=script)) as url:
        body = {"prompt": "hi", "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", json={**body, "use_kv_cache": False})
        assert r.status_code == 200 and r.headers["x-conv-kv"] == "disabled"
        r = httpx.post(url + "/v1/completions", json={**body, "extra_body": {"kv_bits": 4}})
        assert r.status_code == 200 and r.headers["x-conv-kv"] == "fresh"
        r = httpx.post(url + "/v1/completions", json={**body, "kv_bits": 5})
        assert "kv_bits" in assert_error(r, 400, None)["param"]
    assert seen[0].cache is None and seen[1].cache.kv_bits == 4


def test_completions_default_to_16_tokens_within_the_context():
    """OpenAI's default for the legacy endpoint, clipped to the room the prompt
    leaves (as an omitted limit is everywhere), not refused as if asked for."""
    with serve_app(make_app(context_length=64)) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": [5] * 20}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
        r = httpx.post(url + "/v1/completions", json={"prompt": [5] * 60}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        r = httpx.post(
            url + "/v1/completions", json={"prompt": [5] * 60, "max_tokens": 16}, timeout=30
        )
        assert r.status_code == 400  # asked for: kept as asked, and it does not fit


def test_streaming_framing_and_usage(base):
    body = {
        "messages": msgs(),
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", base + CHAT, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        # the engine admitted it before the headers went: they say what the cache did
        assert r.headers["x-conv-kv"] == "fresh" and r.headers["x-conv-cached-tokens"] == "0"
        assert int(r.headers["x-conv-processing-tokens"]) > 0 and r.headers["x-conv-id"]
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    first = chunks[0]["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": "", "message_id": first["message_id"]}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "w0 w1 w2 "
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])


def test_streaming_without_usage_has_no_usage_field(base):
    with httpx.stream(
        "POST", base + CHAT, json={"messages": msgs(), "max_tokens": 2, "stream": True}
    ) as r:
        events = sse_events(r)
    assert all("usage" not in e for e in events[:-1])


@pytest.mark.parametrize(
    "content, payload",
    [
        ("application/json", b'{"messages": [{"role": "user", "content": "x"}'),  # truncated JSON
        ("application/json", b"[1, 2]"),
        ("application/json", b'{"messages": []}'),
        ("application/json", b'{"messages": "hello"}'),
        ("application/json", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
        (
            "application/json",
            b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
        ),
        ("application/json", b'{"messages": [{"role": "user", "content": "x"}], "n": 2}'),
        (
            "application/json",
            b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {}}',
        ),
        (
            "application/json",
            b'{"messages": [{"role": "user", "content": "x"}], "include_stop_str_in_output": true}',
        ),
        (
            "application/json",
            b'{"messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}',
        ),
        (
            "application/json",
            b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
        ),
        (
            "application/json",
            b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999": 1}}',
        ),
        (
            "application/json",
            b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}',
        ),
        ("text/plain", b"not json"),
    ],
)
def test_malformed_requests_get_400_in_openai_shape(base, content, payload):
    r = httpx.post(base + CHAT, content=payload, headers={"content-type": content})
    assert_error(r, 400, type_="invalid_request_error")
    assert "detail" not in r.json()


def test_over_context_is_400_context_length_exceeded(base):
    r = httpx.post(base + CHAT, json={"messages": msgs(), "max_tokens": 2040})
    err = assert_error(r, 400, "context_length_exceeded")
    assert "2048" in err["message"]


def test_prompt_longer_than_context_without_max_tokens_is_400(base):
    r = httpx.post(base + CHAT, json={"messages": msgs("x" * 3000)})
    assert_error(r, 400, "context_length_exceeded")


@pytest.mark.parametrize("prompt", [[""], ["", ""], [[]]])
def test_a_completion_prompt_of_nothing_is_400_not_an_engine_error(base, prompt):
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    assert assert_error(r, 400)["param"].startswith("prompt")


@pytest.mark.parametrize("best_of", [0, 5])
def test_best_of_other_than_one_is_refused_as_n_is(base, best_of):
    """best_of 5 (and 0) answered 200 with one sample, its only sign a header."""
    r = httpx.post(
        base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "best_of": best_of}
    )
    assert assert_error(r, 400)["param"] == "best_of"
    ok = {"prompt": "hi", "max_tokens": 2, "best_of": 1}
    assert httpx.post(base + "/v1/completions", json=ok).status_code == 200


@pytest.mark.parametrize(
    "prompt", [["Hello", "World"], [[1, 2], [3, 4]], [[1, 2, 3], "x"], ["a", "b", "c"]]
)
def test_a_batch_of_completion_prompts_is_refused_for_what_it_is(base, prompt):
    """A batch got "prompt.0: Input should be a valid integer ... (and 3 more
    problems)": a type error about a well-formed prompt."""
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    err = assert_error(r, 400, "invalid_request")
    assert err["param"] == "prompt"
    assert "one prompt per request" in err["message"] and "separate requests" in err["message"]
    assert "more problems" not in err["message"]


@pytest.mark.parametrize("prompt", ["hi", ["hi"], [5, 6, 7], [[5, 6, 7]]])
def test_one_completion_prompt_in_each_shape_is_served(base, prompt):
    """A list of one token-id list (OpenAI's array of token arrays) was a 400
    "prompt.0: Input should be a valid string"."""
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    if isinstance(prompt[0], list) or isinstance(prompt[0], int):
        assert r.json()["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    "path, body, field",
    [
        (CHAT, {"messages": msgs(), "n": 2}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 3}, "n"),
        ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ],
)
def test_more_than_one_choice_is_refused_with_a_reason(base, path, body, field):
    """n 2 said only "Input should be 1 (got 2)"."""
    err = assert_error(httpx.post(base + path, json=body), 400, "invalid_request")
    assert err["param"] == field
    assert "one choice per request" in err["message"], err["message"]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_stream_options_without_stream_names_the_field(base, path):
    """The refusal said "param": null: a whole-body check named no field."""
    body = {"messages": msgs(), "prompt": "hi", "stream_options": {"include_usage": True}}
    err = assert_error(httpx.post(base + path, json=body), 400, "invalid_request")
    assert err["param"] == "stream_options"


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, {"messages": msgs(), "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": msgs(), "logit_bias": {"99999": 1}}, "logit_bias"),
        (CHAT, {"messages": msgs(), "tool_choice": "required"}, "tool_choice"),
        (CHAT, {"messages": msgs(), "tool_choice": "sometimes"}, "tool_choice"),
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "logprobs"),
    ],
)
def test_a_refused_field_has_the_schema_errors_code(base, path, body, param):
    """Refusals raised by the handlers said "code": null where the schema's own
    said "invalid_request": one client check had to look for both."""
    err = assert_error(httpx.post(base + path, json=body), 400, "invalid_request")
    assert err["param"] == param


def test_specific_codes_stay_specific(base):
    r = httpx.post(base + CHAT, json={"messages": msgs(), "max_tokens": 2040})
    assert_error(r, 400, "context_length_exceeded")


@pytest.mark.parametrize("prompt", [[72, 105, 33], [[72, 105, 33]]])
def test_echo_of_a_token_id_prompt_is_its_decoded_text(prompt):
    """echo with token ids was a 400 "echo needs a text prompt"; vLLM echoes the
    ids' text. The decoding is preparation work: off the event loop."""
    loops: list[bool] = []
    app = make_app(eos_after=2)

    def decode(ids):
        try:
            asyncio.get_running_loop()
            loops.append(True)
        except RuntimeError:
            loops.append(False)
        return "".join(map(chr, ids))

    with serve_app(app) as url:
        app.state.kvwarm.engine.info.formatter.decode = decode
        body = {"prompt": prompt, "echo": True, "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "Hi!w0 w1 "
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as s:
            texts = [
                json.loads(line[6:])["choices"][0]["text"]
                for line in s.iter_lines()
                if line.startswith("data: {")
            ]
        assert texts[0] == "Hi!" and "".join(texts) == "Hi!w0 w1 "
    assert loops == [False, False]


def test_a_client_leaving_mid_body_is_no_server_error(caplog):
    """The client hung up after part of its body: nobody to answer, nothing failed
    (it was logged as an unhandled error with a traceback, and a 500 sent)."""
    caplog.set_level(logging.INFO, logger="kvwarm")
    app = make_app()
    messages = [
        {"type": "http.request", "body": b'{"model":', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": CHAT,
        "raw_path": CHAT.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", b"1000"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    with serve_app(app):  # started: the route's state exists
        asyncio.run(app(scope, receive, send))
    assert sent == [], [m.get("body") for m in sent]
    assert any("left before sending its body" in m for m in caplog.messages), caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_over_budget_is_400_memory_admission_naming_the_ceiling():
    with serve_app(make_app(context_length=8192, kv_budget_tokens=1024)) as url:
        r = httpx.post(url + CHAT, json={"messages": msgs(), "max_tokens": 2000})
        err = assert_error(r, 400, "context_over_budget", "memory_admission")
        assert "1024" in err["message"]  # the ceiling
        ok = httpx.post(url + CHAT, json={"messages": msgs(), "max_tokens": 100})
        assert ok.status_code == 200
        # no limit given: the server's default (2048) is held under the ceiling, not refused
        for path, body in ((CHAT, {"messages": msgs()}), ("/v1/completions", {"prompt": "hi"})):
            unset = httpx.post(url + path, json=body, timeout=120)
            assert unset.status_code == 200, unset.text


def test_unknown_route_and_method_use_the_error_shape(base):
    assert_error(httpx.get(base + "/v1/nope"), 404)
    assert_error(httpx.get(base + CHAT), 405)


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", CHAT, {"POST"}),
        ("PUT", "/v1/messages", {"POST"}),
        ("PUT", "/v1/adapters", {"GET", "POST"}),
        ("POST", "/v1/models", {"GET"}),
        # its own resource: not a conversation id /v1/conv_kv/{id} (DELETE) also takes
        ("PUT", "/v1/conv_kv/save", {"POST"}),
        # nor to DELETE: the conversation-id route refuses the reserved names (it took
        # them and answered 400 "prefix cache is off" while Allow said POST / GET)
        ("DELETE", "/v1/conv_kv/save", {"POST"}),
        ("DELETE", "/v1/conv_kv/load", {"POST"}),
        ("DELETE", "/v1/conv_kv/stats", {"GET"}),
    ],
)
def test_a_405_names_the_methods_the_path_serves(base, method, path, allowed):
    """Routes of an included router (20 of 24) answered 405 with an empty Allow:
    the handler looked only at the app's own routes, and replaced Starlette's."""
    r = httpx.request(method, base + path)
    assert r.status_code == 405, r.text
    assert {m.strip() for m in r.headers["allow"].split(",")} == allowed, r.headers


def test_models_health_and_stats(base):
    models = httpx.get(base + "/v1/models").json()
    assert models["data"][0]["id"] == "fake-model"
    assert models["data"][0]["context_length"] == 2048
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    stats = httpx.get(base + "/stats").json()
    assert stats["model"] == "fake-model"
    assert stats["admission"]["ceiling_tokens"] == 4096
    assert stats["admission"]["budget_bytes"] > 0
    assert stats["batch"]["configured"] == 8
    assert "active_rows" in stats["batch"] and stats["queue"]["depth"] == 0
    assert isinstance(stats["engine"]["steps"], int)  # the step count, next to the budget's view
    assert stats["engine"]["step_budget"]["steps"] == stats["engine"]["steps"]


def _wait(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


JSON_HEADERS = {"content-type": "application/json"}


def test_full_queue_is_429_with_retry_after():
    settings = Settings(_env_file=None, batch=1, max_queue=1)
    with serve_app(make_app(settings, step_delay=0.01)) as url:
        body = {"messages": msgs(), "max_tokens": 100000 // 100, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + CHAT, json=body) as running:
            running_lines = running.iter_lines()  # keep a reference: closing it disconnects
            next(running_lines)
            with httpx.Client(timeout=30) as c:
                stats = lambda: c.get(url + "/stats").json()  # noqa: E731
                with c.stream("POST", url + CHAT, json=body) as queued:
                    _wait(lambda: stats()["queue"]["depth"] == 1)
                    r = c.post(url + CHAT, json={"messages": msgs(), "max_tokens": 5})
                    err = assert_error(r, 429, "queue_full")
                    assert int(r.headers["retry-after"]) >= 1
                    assert "--max-queue 1" in err["message"]
                    # refused before its body is read, parsed or rendered (each refused
                    # request of a retry storm had taken a preparation slot first)
                    bad = c.post(url + CHAT, content=b"{not json", headers=JSON_HEADERS)
                    assert_error(bad, 429, "queue_full")
                    assert queued.status_code == 200
            assert running.status_code == 200


def read_until_content(lines) -> None:
    """Consume SSE lines until the first generated token has arrived."""
    for line in lines:
        if line.startswith("data: {") and '"content":"w' in line:
            return
    raise AssertionError("stream ended before any content")


def test_client_disconnect_aborts_and_frees_the_slot():
    settings = Settings(_env_file=None, batch=1)
    app = make_app(settings, step_delay=0.01)
    with serve_app(app) as url:
        engine = app.state.kvwarm.engine
        body = {"messages": msgs(), "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", url + CHAT, json=body) as r:
            lines = r.iter_lines()
            read_until_content(lines)
            assert engine.engine_stats().active_rows == 1
        _wait(lambda: engine.engine_stats().active_rows == 0)
        stats = httpx.get(url + "/stats").json()
        assert stats["requests"]["aborted"] == 1 and stats["batch"]["running_requests"] == 0
        # the freed slot serves the next request straight away
        r = httpx.post(url + CHAT, json={"messages": msgs(), "max_tokens": 2}, timeout=5)
        assert r.status_code == 200


def test_non_streaming_disconnect_aborts_too():
    app = make_app(Settings(_env_file=None, batch=1), step_delay=0.01)
    with serve_app(app) as url:
        engine = app.state.kvwarm.engine
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + CHAT, json={"messages": msgs(), "max_tokens": 1000}, timeout=0.3)
        _wait(lambda: app.state.kvwarm.service.scheduler.stats().aborted_total == 1)
        _wait(lambda: engine.engine_stats().active_rows == 0)


def test_a_non_streamed_response_whose_client_left_is_not_stored():
    """The handler went on after the hang-up: it stored the partial reply under
    status "completed", for a previous_response_id nobody would send."""
    app = make_app(Settings(_env_file=None, batch=1), step_delay=0.01)
    with serve_app(app) as url:
        state = app.state.kvwarm
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                url + "/v1/responses", json={"input": "hi", "max_output_tokens": 1000}, timeout=0.3
            )
        _wait(lambda: state.service.scheduler.stats().aborted_total == 1)
        _wait(lambda: state.engine.engine_stats().active_rows == 0)
        time.sleep(0.3)  # the handler's own work after the abort
        assert len(state.responses) == 0
        done = httpx.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        assert done.status_code == 200 and len(state.responses) == 1


def test_engine_death_ends_streams_with_an_error_and_health_turns_503():
    app = make_app(step_delay=0.01)
    with serve_app(app) as url:
        engine = app.state.kvwarm.engine
        body = {"messages": msgs(), "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", url + CHAT, json=body, timeout=10) as r:
            lines = r.iter_lines()
            next(lines)
            engine.inject_fault(RuntimeError("GPU fell over"))
            events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert events[-1]["error"]["code"] == "engine_error"
        assert "GPU fell over" in events[-1]["error"]["message"]
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        refused = httpx.post(url + CHAT, json={"messages": msgs()})
        assert_error(refused, 503, "engine_unavailable")
        assert refused.headers["x-should-retry"] == "false"  # the SDKs retry a 503 otherwise
        assert_error(httpx.get(url + "/v1/models"), 503, "engine_unavailable")


def test_a_request_still_queued_when_the_engine_dies_gets_a_503_to_retry():
    """It failed nothing of its own: it got the running request's 500 "Generation
    failed", while one sent a moment later got 503 engine_unavailable."""
    app = make_app(Settings(_env_file=None, batch=1), step_delay=0.05)
    with serve_app(app) as url:
        engine = app.state.kvwarm.engine
        results: dict[str, httpx.Response] = {}

        def ask(name: str) -> None:
            body = {"messages": msgs(name), "max_tokens": 1000}
            results[name] = httpx.post(url + CHAT, json=body, timeout=30)

        threads = [threading.Thread(target=ask, args=(n,)) for n in ("running", "queued")]
        for t in threads:
            t.start()
            time.sleep(0.3)
        _wait(lambda: app.state.kvwarm.service.scheduler.stats().waiting == 1)
        engine.inject_fault(RuntimeError("GPU fell over"))
        for t in threads:
            t.join()
        assert_error(results["running"], 500, "engine_error")
        assert_error(results["queued"], 503, "engine_unavailable")
        later = httpx.post(url + CHAT, json={"messages": msgs()}, timeout=30)
        assert_error(later, 503, "engine_unavailable")  # what one a moment later gets
        assert results["queued"].headers.get("retry-after") == later.headers.get("retry-after")
        # down for good: neither is worth the SDKs' automatic retries
        assert results["queued"].headers["x-should-retry"] == later.headers["x-should-retry"]
        assert later.headers["x-should-retry"] == "false"


def test_a_conversation_that_cannot_fit_is_refused_before_it_is_scanned(monkeypatch):
    """The healing and volatile-rule passes (regexes holding the GIL) ran over all
    of a conversation before its length was looked at: 8 MB of system text stalled
    every stream 0.9 s, to end in a 400 all the same."""
    from scheduler.admission import ContextLengthExceeded
    from tests.helpers.fake_engine import CharFormatter

    def too_long(self, texts, count_only=False):
        # every role's text but the model's own (templates drop its past reasoning)
        assert sum(map(len, texts)) == 5000
        raise ContextLengthExceeded("too long")

    monkeypatch.setattr(CharFormatter, "check_texts", too_long)
    app = make_app()
    with serve_app(app) as url:
        scanned = []
        monkeypatch.setattr(
            app.state.kvwarm.healing, "contexts", lambda *a: scanned.append(1) or []
        )
        messages = [
            {"role": "system", "content": "s" * 4000},
            {"role": "assistant", "content": "<think>" + "r" * 9000 + "</think>ok"},
            {"role": "user", "content": [{"type": "text", "text": "u" * 1000}]},
        ]
        r = httpx.post(url + CHAT, json={"messages": messages})
        assert_error(r, 400, "context_length_exceeded")
        assert scanned == []


def test_a_conversation_that_cannot_fit_fetches_and_decodes_no_image(monkeypatch):
    """Its images were fetched (up to --fetch-timeout each) and decoded before its
    text's length was looked at, to end in a 400 all the same. The text alone is
    checked first; with its images' notes (or placeholders) in it, again."""
    import app.image_prompt as image_prompt
    from app.images import LoadedImage
    from scheduler.admission import ContextLengthExceeded
    from tests.helpers.fake_engine import CharFormatter

    limit, checked, loaded = [0], [], []

    def too_long(self, texts, count_only=False):
        checked.append(sum(map(len, texts)))
        if checked[-1] > limit[0]:
            raise ContextLengthExceeded("too long")

    def load(sources, limits, fields=None):
        loaded.append(sources)  # a download and a decode each
        return [[LoadedImage(None, bytes(16))] for _ in sources]

    monkeypatch.setattr(CharFormatter, "check_texts", too_long)
    monkeypatch.setattr(image_prompt, "load_images", load)
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    content = [image, {"type": "text", "text": "u" * 1000}]
    with serve_app(make_app(Settings(_env_file=None, images="placeholder"))) as url:
        for limit[0], checks, loads in ((999, 1, 0), (1010, 2, 1)):
            checked.clear(), loaded.clear()
            r = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": content}]})
            assert_error(r, 400, "context_length_exceeded")
            assert (len(checked), len(loaded)) == (checks, loads)
    assert checked[0] == 1000 < checked[1]  # then with "[image 1: ...]"


@pytest.fixture(scope="module")
def secured():
    settings = Settings(_env_file=None, api_key="sekrit", max_body_bytes="2KiB")
    with serve_app(make_app(settings)) as url:
        yield url


class TestAuthAndLimits:
    @pytest.fixture
    def url(self, secured):
        return secured

    def test_missing_or_wrong_key_is_401(self, url):
        assert_error(httpx.post(url + CHAT, json={"messages": msgs()}), 401, "invalid_api_key")
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert_error(r, 401, type_="authentication_error")
        assert_error(httpx.get(url + "/stats"), 401)

    def test_bearer_or_x_api_key_pass(self, url):
        r = httpx.post(
            url + CHAT,
            json={"messages": msgs(), "max_tokens": 1},
            headers={"Authorization": "Bearer sekrit"},
        )
        assert r.status_code == 200
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "sekrit"}).status_code == 200

    def test_health_needs_no_key(self, url):
        assert httpx.get(url + "/health").status_code == 200

    def test_the_key_is_asked_for_before_the_body_is_measured(self, url):
        """Without a key, a large body is a 401, and nothing is counted: the size
        check ran first, answering 413 to anyone and counting each one as a refused
        request (anyone who could reach the port could draw the rejection graph)."""

        def rejected() -> float:
            text = httpx.get(url + "/metrics", headers={"x-api-key": "sekrit"}).text
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("kvwarm:requests_rejected_total{")
            )

        before = rejected()
        big = {"messages": msgs("x" * 5000)}
        assert_error(httpx.post(url + CHAT, json=big), 401, "invalid_api_key")
        assert rejected() == before

    def test_oversized_body_is_413(self, url):
        big = {"messages": msgs("x" * 5000)}
        r = httpx.post(url + CHAT, json=big, headers={"x-api-key": "sekrit"})
        assert_error(r, 413, "body_too_large")

    def test_oversized_chunked_body_is_413(self, url):
        def gen():
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}]}'

        r = httpx.post(
            url + CHAT,
            content=gen(),
            headers={"x-api-key": "sekrit", "content-type": "application/json"},
        )
        assert_error(r, 413)


class LoadingEngine(FakeEngine):
    """Ready only once the test says the model has loaded."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.loaded = __import__("threading").Event()

    ready = property(lambda self: self.loaded.is_set() and self.alive)


def test_health_is_503_while_loading_then_200():
    app = create_app(Settings(_env_file=None), lambda s, r: LoadingEngine(s, r))
    with serve_app(app, wait_ready=False) as url:
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        assert r.headers["retry-after"] == "5"
        refused = httpx.post(url + CHAT, json={"messages": msgs()})
        assert_error(refused, 503, "loading")
        assert refused.headers["retry-after"] == "5"
        assert httpx.get(url + "/stats").json()["status"] == "loading"
        app.state.kvwarm.engine.loaded.set()
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + CHAT, json={"messages": msgs(), "max_tokens": 1}).status_code == 200


def test_placeholder_images_keep_their_number_by_content_wherever_they_are_sent():
    """--images placeholder on a text model: each image becomes a note numbered by
    its pixels, so the same image re-sent (re-encoded, or in a tool result) keeps
    its number, and the conversation can move between a vision and a text model."""
    import base64
    import io

    from PIL import Image

    def url(color, fmt="PNG"):
        buf = io.BytesIO()
        Image.new("RGB", (6, 4), color).save(buf, format=fmt)
        mime = f"image/{fmt.lower()}"
        return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"

    def part(u):
        return {"type": "image_url", "image_url": {"url": u}}

    engines = []

    def engine(s, r):
        engines.append(FakeEngine(s, r, eos_after=2))
        return engines[-1]

    green, red = (0, 200, 0), (200, 0, 0)
    messages = [
        {"role": "user", "content": [part(url(green)), {"type": "text", "text": "this?"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [part(url(red)), {"type": "text", "text": "and this?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [part(url(green, "BMP"))]},
    ]
    with serve_app(create_app(Settings(_env_file=None, images="placeholder"), engine)) as base:
        r = httpx.post(base + CHAT, json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text
        seen = [str(m.get("content")) for m in engines[0].info.formatter.last_messages]
    first, second, tool = seen[0], seen[2], seen[4]
    note = first[first.index("[image 1: ") :].split("]")[0]
    assert len(note) == len("[image 1: ") + 12  # a 12-hex id of the pixels
    assert note in tool and "[image 2: " in second and note not in second
    default = make_app()  # --images reject: a 400 naming the flag
    with serve_app(default) as base:
        r = httpx.post(base + CHAT, json={"messages": messages[:1], "max_tokens": 2})
    assert r.status_code == 400 and "--images" in r.text


def test_a_conversation_id_with_a_slash_can_be_deleted():
    """Session ids come from headers and body fields with any characters; save and
    load take them in the body, delete in the path, where "team/alice" was a 404."""
    from concurrent.futures import Future

    from kvcache.interface import SavedConversation

    deleted: list[str] = []

    class Store:
        def delete_conversation(self, conversation_id: str) -> SavedConversation:
            deleted.append(conversation_id)
            return SavedConversation(conversation_id, None, 10, 100, "ram", None)

    def kv(op):
        future: Future = Future()
        future.set_result(op(Store()))
        return future

    app = make_app()
    with serve_app(app) as base:
        app.state.kvwarm.engine.kv = kv
        r = httpx.delete(base + "/v1/conv_kv/team/alice")
        # a reserved name is an id where it is not the whole path's last part
        others = [httpx.delete(base + f"/v1/conv_kv/{i}") for i in ("saved", "stats/x", "x/load")]
    assert r.status_code == 200 and r.json()["conversation_id"] == "team/alice"
    assert [o.status_code for o in others] == [200, 200, 200]
    assert deleted == ["team/alice", "saved", "stats/x", "x/load"]


def test_the_document_keeps_the_reserved_names_out_of_conversation_ids():
    """What routing refuses the document does not offer (schemathesis would send
    DELETE /v1/conv_kv/save and get a 405 the operation never states)."""
    doc = make_app().openapi()
    delete = doc["paths"]["/v1/conv_kv/{conversation_id}"]["delete"]
    (param,) = delete["parameters"]
    assert param["schema"]["not"] == {"enum": ["save", "load", "stats"]}
    assert "Allow" in delete["responses"]["405"]["headers"]  # what such a DELETE gets


def test_behind_a_key_health_says_the_engine_stopped_but_not_its_exception():
    """/health needs no key: it handed anyone the engine's exception text."""
    settings = Settings(_env_file=None, api_key="k")
    app = make_app(settings, step_delay=0.01)
    with serve_app(app) as url:
        app.state.kvwarm.engine.inject_fault(RuntimeError("/home/me/secret-model failed"))
        _wait(lambda: httpx.get(url + "/health").status_code == 503)
        health = httpx.get(url + "/health").json()
        assert health["status"] == "error" and "secret-model" not in health["error"]
        stats = httpx.get(url + "/stats", headers={"Authorization": "Bearer k"}).json()
        assert "secret-model" in json.dumps(stats)


def test_a_path_in_an_unhandled_error_log_line_cannot_forge_lines(caplog):
    """The path is percent-decoded: a %0A in a route's path parameter wrote a
    line of the client's choosing into the server log."""
    import asyncio

    from app.errors import InternalErrorMiddleware

    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {
        "type": "http",
        "method": "DELETE",
        "path": "/v1/adapters/x\nERROR forged line",
        "headers": [],
    }
    with caplog.at_level("ERROR"):
        asyncio.run(InternalErrorMiddleware(broken)(scope, receive, send))
    assert sent[0]["status"] == 500
    assert all("\n" not in r.getMessage() for r in caplog.records)


def test_only_a_conversations_own_id_makes_its_cache_hints_its_own():
    """A prompt_cache_key may be one app's for all its users, and a fallback id is
    shared by every conversation whose first tokens agree: neither may read what
    only another conversation sent (a reminder only a cached entry holds)."""
    seen = []
    with serve_app(make_app(eos_after=2, script=seen.append)) as url:
        for extra in ({"conversation_id": "c-1"}, {"prompt_cache_key": "acme-bot"}, {}):
            body = {"messages": msgs(), "max_tokens": 2, **extra}
            assert httpx.post(url + CHAT, json=body).status_code == 200
    assert [r.cache.own_conversation for r in seen] == [True, False, False]
    assert seen[1].cache.session_id == "acme-bot"  # still the session layer's key


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_monitors_may_probe_health_and_metrics_with_head(base, path):
    """Load balancers and uptime monitors send HEAD: it was a 405."""
    got = httpx.get(base + path)
    r = httpx.head(base + path)
    assert r.status_code == 200 and r.content == b"", r.headers
    assert r.headers["content-type"] == got.headers["content-type"]
    assert "head" in httpx.get(base + "/openapi.json").json()["paths"][path]
