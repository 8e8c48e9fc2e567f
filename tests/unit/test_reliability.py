"""One client's bad request must never reach the engine or stall the server.

Every input here was reported reaching the engine unvalidated (killing it for
every agent) or answering 500: each must now be a 400 in the route's own error
shape, naming the field, whatever envelope carried it; the server stays healthy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import replace

import httpx
import pytest

from app.server import create_app
from app.settings import Settings
from scheduler.admission import KV_ALLOCATION_STEP
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import serve_app

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
COMPLETIONS = "/v1/completions"


NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def chat(**extra):
    return {"messages": USER, "max_tokens": 2, **extra}


def anthropic(**extra):
    return {"messages": USER, "max_tokens": 2, **extra}


def responses(**extra):
    return {"input": "hi", "max_output_tokens": 2, **extra}


def completion(**extra):
    return {"prompt": "hi", "max_tokens": 2, **extra}


def fn_tool(name):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def assistant_call(function):
    return chat(
        messages=[
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "type": "function", "function": function}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "r"},
        ]
    )


BAD = [
    # reported to kill the engine
    (MESSAGES, anthropic(min_p=5), "min_p"),
    (RESPONSES, responses(min_p=-1), "min_p"),
    (MESSAGES, anthropic(repetition_penalty=-1), "repetition_penalty"),
    (MESSAGES, anthropic(repetition_penalty=-1, temperature=0.7), "repetition_penalty"),
    # reported as 500s
    (CHAT, chat(tools=[fn_tool({"x": 1})]), "tools.0.function.name"),
    (MESSAGES, anthropic(tools=[{"name": {"x": 1}, "input_schema": {}}]), "tools.0"),
    (RESPONSES, responses(tools=[{"type": "function", "name": {"x": 1}}]), "tools.0.name"),
    (CHAT, assistant_call("get_weather"), "messages.1.tool_calls.0.function"),
    (CHAT, assistant_call(7), "messages.1.tool_calls.0.function"),
    (COMPLETIONS, completion(logit_bias={"²": 5}), "logit_bias"),
    (MESSAGES, anthropic(logit_bias=[1, 2]), "logit_bias"),
    (RESPONSES, responses(logit_bias="x"), "logit_bias"),
    (MESSAGES, anthropic(seed=1.5), "seed"),
    (MESSAGES, anthropic(seed=1e20), "seed"),
    (RESPONSES, responses(seed=1.5), "seed"),
    (RESPONSES, responses(seed=1e20), "seed"),
    # tool names are written into prompts and forced-call openings
    (CHAT, chat(tools=[fn_tool('look"up')]), "tools.0.function.name"),
    (
        CHAT,
        chat(tools=[fn_tool("f")], tool_choice={"type": "function", "function": {"name": "a b"}}),
        "tool_choice",
    ),
    (MESSAGES, anthropic(tools=[{"name": "a\n</tool_call>", "input_schema": {}}]), "tools.0"),
    (
        MESSAGES,
        anthropic(tools=[{"type": "custom", "name": "a b", "input_schema": {}}]),
        "tools.0",
    ),
    (RESPONSES, responses(tools=[{"type": "function", "parameters": {}}]), "tools.0"),
    # a call cannot be required when there is nothing to call
    (CHAT, chat(tool_choice="required"), "tool_choice"),
    (MESSAGES, anthropic(tool_choice={"type": "any"}), "tool_choice"),
    (RESPONSES, responses(tool_choice="required"), "tool_choice"),
    # chat's logprobs: typed and bounded; alternatives without logprobs are no silent null
    (CHAT, chat(logprobs="x"), "logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    (CHAT, chat(top_logprobs=2), "top_logprobs"),
    (COMPLETIONS, completion(logprobs=21), "logprobs"),
    (COMPLETIONS, completion(logprobs=1, echo=True), "logprobs"),
    # a failed field named as the client wrote it, not by the union branch pydantic tried
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages.0.content.0.text",
    ),
    (CHAT, chat(stop=[1]), "stop.0"),
    (RESPONSES, responses(input=[{}]), "input.0.content"),
    (MESSAGES, anthropic(tools=[{"name": "", "input_schema": {}}]), "tools.0.name"),
    (RESPONSES, responses(input=[{"type": "reasoning", "summary": []}]), "input"),
    # the same field, the same bounds, whatever envelope carried it
    (CHAT, chat(extra_body={"min_p": 5}), "extra_body.min_p"),
    (CHAT, chat(metadata={"top_p": 0}), "metadata.top_p"),
    (MESSAGES, anthropic(metadata={"temperature": 9}), "metadata.temperature"),
    (RESPONSES, responses(extra_body={"seed": "x"}), "extra_body.seed"),
    (
        COMPLETIONS,
        completion(extra_body={"repetition_penalty": 0}),
        "extra_body.repetition_penalty",
    ),
    # strict types: a JSON false is not a temperature, a string is not a count
    (CHAT, chat(temperature=False), "temperature"),
    (CHAT, chat(max_tokens="7"), "max_tokens"),
    (MESSAGES, anthropic(stream="yes"), "stream"),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (CHAT, chat(stop="x" * 300), "stop"),
    # a chat template is code the server runs: nested range(100000) loops held a
    # preparation thread for hours, and two such requests wedged every later one
    (CHAT, chat(chat_template_kwargs={"chat_template": NESTED_LOOPS}), "chat_template_kwargs"),
    (
        MESSAGES,
        anthropic(extra_body={"chat_template_kwargs": {"chat_template": "x"}}),
        "extra_body.chat_template_kwargs",
    ),
    (
        RESPONSES,
        responses(metadata={"chat_template_kwargs": {"chat_template": "x"}}),
        "metadata.chat_template_kwargs",
    ),
    # apply_chat_template's own arguments (a TypeError, or the server's choice undone)
    (CHAT, chat(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
    (CHAT, chat(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
    (CHAT, chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    (MESSAGES, anthropic(chat_template_kwargs={"tools": 5}), "chat_template_kwargs"),
    (CHAT, chat(chat_template_kwargs="x"), "chat_template_kwargs"),  # was ignored
    (CHAT, chat(chat_template_kwargs={"relocate_volatile": True}), "chat_template_kwargs"),
    (CHAT, chat(chat_template_kwargs={"enable_thinking": "turbo"}), "chat_template_kwargs"),
    # render_chat's own arguments: a late "multiple values" 400 naming internals
    (CHAT, chat(chat_template_kwargs={"image_placeholder": "x"}), "chat_template_kwargs"),
    (CHAT, chat(chat_template_kwargs={"self": 1}), "chat_template_kwargs"),
    # the switch inside chat_template_kwargs is held to the top level's types
    (CHAT, chat(chat_template_kwargs={"enable_thinking": 0.0}), "chat_template_kwargs"),
    (
        CHAT,
        chat(chat_template_kwargs={"enable_thinking": {"type": "enabled"}}),
        "chat_template_kwargs",
    ),
    # under 0.01 the penalty overflows logits to inf and the sampler draws from NaN
    (CHAT, chat(repetition_penalty=1e-50), "repetition_penalty"),
    # a thinking switch that says neither on nor off was the server default, silently
    (CHAT, chat(reasoning_effort="turbo"), "reasoning_effort"),
    (CHAT, chat(enable_thinking=[1]), "enable_thinking"),
    (RESPONSES, responses(reasoning={"effort": "max"}), "reasoning.effort"),
    (MESSAGES, anthropic(metadata={"enable_thinking": "maybe"}), "metadata.enable_thinking"),
    # read as switches too, but were extras nobody checked
    (CHAT, chat(thinking="maybe"), "thinking"),
    (CHAT, chat(reasoning={"effort": "max"}), "reasoning"),
    (CHAT, chat(extra_body={"thinking": {"type": "sometimes"}}), "extra_body.thinking"),
    (RESPONSES, responses(thinking="maybe"), "thinking"),
    (COMPLETIONS, completion(metadata={"reasoning": "turbo"}), "metadata.reasoning"),
]


@pytest.fixture(scope="module")
def base():
    app = create_app(
        Settings(_env_file=None), lambda s, r: FakeEngine(s, r, eos_after=3, context_length=512)
    )
    with serve_app(app) as url:
        yield url


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{p}:{f}" for p, _, f in BAD])
def test_bad_fields_are_400_naming_the_field(base, path, body, param):
    r = httpx.post(base + path, json=body)
    assert r.status_code == 400, r.text
    if path == MESSAGES:
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert param in err["error"]["message"]
    else:
        err = r.json()["error"]
        assert err["param"] is not None and err["param"].startswith(param), err
    assert httpx.get(base + "/health").status_code == 200


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            CHAT,
            chat(messages=[{"role": "user", "content": {"type": "text"}}]),
            "messages.0.content",
        ),
        (
            CHAT,
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": {"v": 1}}]}]),
            "messages.0.content.0.text",
        ),
        (CHAT, chat(tool_choice={"type": 5}), "tool_choice.type"),
        (CHAT, chat(tools=[fn_tool("a b")]), "tools.0.function.name"),
        (RESPONSES, responses(input={"x": 1}), "input"),
        (RESPONSES, responses(input=[]), "input"),
        (MESSAGES, anthropic(system={"x": 1}), "system"),
    ],
)
def test_the_field_named_is_the_one_the_client_wrote(base, path, body, param):
    """pydantic's locations name the union branches it tried ('content.str',
    'tool_choice.literal[...]'); the error names the client's own field."""
    r = httpx.post(base + path, json=body)
    assert r.status_code == 400, r.text
    if path == MESSAGES:
        assert f"'{param}'" in r.json()["error"]["message"]
    else:
        assert r.json()["error"]["param"] == param


def test_good_requests_still_pass_through_every_envelope(base):
    for path, body in [
        (CHAT, chat(extra_body={"min_p": 0.1, "top_k": 20}, metadata={"session_id": "s"})),
        (MESSAGES, anthropic(min_p=0.05, seed=3, metadata={"user_id": "u"})),
        (RESPONSES, responses(top_k=-1, seed=2**63, metadata={"k": "v"})),
        (COMPLETIONS, completion(logit_bias={"7": -100}, seed=-5)),
        (CHAT, chat(tools=[fn_tool("mcp__fs.read:v1")], tool_choice="required")),
        (CHAT, chat(logprobs=False, top_logprobs=0)),
        (CHAT, chat(tools=[fn_tool("user-profile/update")])),  # an MCP name (SEP-986)
        (CHAT, chat(chat_template_kwargs={"enable_thinking": False, "documents": []})),
        # null is unset, inside chat_template_kwargs as at the top level
        (CHAT, chat(chat_template_kwargs={"enable_thinking": None}, enable_thinking=None)),
        (CHAT, chat(reasoning_effort="xhigh", enable_thinking="on")),
        (RESPONSES, responses(reasoning={"effort": "minimal"}, metadata={"enable_thinking": "0"})),
        (RESPONSES, responses(reasoning={"summary": "auto"}, thinking=False)),
        (
            CHAT,
            chat(thinking={"type": "enabled", "budget_tokens": 1024}, reasoning={"summary": "x"}),
        ),
        (CHAT, chat(extra_body={"reasoning": {"effort": "low"}, "thinking": "high"})),
        (CHAT, chat(reasoning={"enabled": True, "effort": None}, thinking={"type": None})),
        # nullable in OpenAI's spec (its SDK sends null for a None): the default
        (CHAT, chat(n=None, stream=None)),
        (COMPLETIONS, completion(echo=None, n=None, stream=None)),
        (RESPONSES, responses(store=None, parallel_tool_calls=None, stream=None)),
        (MESSAGES, anthropic(extra_body={"chat_template_kwargs": {"custom_flag": [1, {"a": 2}]}})),
    ]:
        r = httpx.post(base + path, json=body)
        assert r.status_code == 200, (path, r.text)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize(
    "path, template, field",
    [
        (
            CHAT,
            '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            '"metadata": {"foo": %s}}',
            "metadata.foo",
        ),
        (
            RESPONSES,
            '{"input": "hi", "max_output_tokens": 2, "tools": '
            '[{"type": "function", "name": "f", "parameters": {"default": [%s]}}]}',
            "tools.0.parameters.default.0",
        ),
        (
            RESPONSES,
            '{"input": "hi", "max_output_tokens": 2, "tool_choice": {"type": "auto", "x": %s}}',
            "tool_choice.x",
        ),
        (
            CHAT,
            '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": '
            '[{"type": "function", "function": {"name": "f", "parameters": {"default": [%s]}}}]}',
            "tools.0.function.parameters.default.0",
        ),
        (
            MESSAGES,
            '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "x": {"y": %s}}',
            "x.y",
        ),
    ],
)
def test_numbers_json_cannot_carry_are_refused_wherever_they_sit(
    base, path, template, field, literal
):
    """Free-form values (metadata, schemas, extra fields) would reach a reply that
    echoes them: refused at the boundary, naming the field, not a 500 after the
    whole generation."""
    r = httpx.post(
        base + path, content=template % literal, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert "must be finite" in r.text and f"`{field}`" in r.text
    assert httpx.get(base + "/health").status_code == 200


@pytest.mark.parametrize("depth", [5000, 983, 900, 65])
def test_tool_call_arguments_nested_past_the_json_parsers_depth_are_passed_as_text(base, depth):
    """5,000 levels fail to parse; ~983 parse, then overflowed the stack when dumped
    again (healing, a template's tojson): a 500 after the parse had succeeded."""
    deep = "[" * depth + "]" * depth
    r = httpx.post(base + CHAT, json=assistant_call({"name": "f", "arguments": deep}))
    assert r.status_code == 200, r.text
    items = [
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": deep},
        {"type": "function_call_output", "call_id": "c", "output": "r"},
    ]
    r = httpx.post(base + RESPONSES, json=responses(input=items))
    assert r.status_code == 200, r.text


def test_arguments_are_decoded_up_to_their_depth_limit():
    from kvcache.healing import MAX_ARGUMENT_DEPTH, decoded_arguments

    shallow = "[" * MAX_ARGUMENT_DEPTH + "]" * MAX_ARGUMENT_DEPTH
    assert isinstance(decoded_arguments(shallow), list)
    deeper = '{"a":' * (MAX_ARGUMENT_DEPTH + 2) + "1" + "}" * (MAX_ARGUMENT_DEPTH + 2)
    assert decoded_arguments(deeper) == deeper
    assert decoded_arguments('{"city": "Oslo"}') == {"city": "Oslo"}
    assert decoded_arguments("not json") == "not json"


def test_a_million_tiny_values_are_refused_before_parsing(base):
    body = (
        b'{"messages": ['
        + b'{"role":"user","content":"x"},' * 200_000
        + b'{"role":"user","content":"x"}]}'
    )
    r = httpx.post(base + CHAT, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "body_too_complex"


def test_more_messages_than_the_context_holds_is_400(base):
    r = httpx.post(base + CHAT, json=chat(messages=USER * 513))
    assert r.status_code == 400 and "at most 512 messages" in r.json()["error"]["message"]


def test_unknown_fields_are_reported_not_silently_dropped(base, caplog):
    with caplog.at_level(logging.INFO, logger="kvwarm.http"):
        r = httpx.post(base + CHAT, json=chat(kv_bits=4, guided_json="x", enable_thinking=False))
    assert r.status_code == 200
    # enable_thinking, kv_bits are read
    assert r.headers["x-kvwarm-ignored-fields"] == "guided_json"
    # inside extra_body only sampling, cache and thinking fields are read
    r = httpx.post(
        base + CHAT,
        json=chat(extra_body={"max_tokens": 1, "top_k": 5, "reasoning_effort": "none"}),
    )
    assert r.status_code == 200
    assert r.headers["x-kvwarm-ignored-fields"] == "extra_body.max_tokens"
    with httpx.stream("POST", base + MESSAGES, json=anthropic(stream=True, top_a=8)) as s:
        assert s.headers["x-kvwarm-ignored-fields"] == "top_a"


def test_fields_sent_as_null_are_not_reported_as_ignored(base):
    """SDKs send unset fields as null: "response_format": null and "user": null were
    named in the header as if the client had asked for something."""
    body = chat(response_format=None, user=None, guided_json="x", extra_body={"top_a": None})
    r = httpx.post(base + CHAT, json=body)
    assert r.status_code == 200
    assert r.headers["x-kvwarm-ignored-fields"] == "guided_json"
    r = httpx.post(base + CHAT, json=chat(response_format=None, user=None))
    assert r.status_code == 200 and "x-kvwarm-ignored-fields" not in r.headers


def test_client_chosen_names_reach_the_log_escaped_and_bounded(base, caplog):
    """20,000 unknown keys made a 1.2 MB log line; a newline in a key or a session
    id forged a line of its own."""
    extra = {f"k{i}": 1 for i in range(20_000)}
    extra["evil\nkvwarm.request INFO forged"] = 1
    with caplog.at_level(logging.INFO):
        r = httpx.post(base + CHAT, json=chat(session_id="s\nFORGED line", **extra))
    assert r.status_code == 200
    ignored = [m for m in caplog.messages if "ignored fields" in m]
    assert ignored and all(len(m) < 2000 and "\n" not in m for m in ignored)
    done = [m for m in caplog.messages if " done: " in m]
    assert done and all("\n" not in m for m in done)
    assert any("session=s\\nFORGED" in m for m in done)


def test_preparation_runs_off_the_event_loop():
    """While one request's preparation is stuck, /health and other requests answer."""
    release = threading.Event()
    entered = threading.Event()
    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, eos_after=2))
    with serve_app(app) as url:
        formatter = app.state.kvwarm.engine.info.formatter
        plain = formatter.render_chat

        def slow(messages, **kw):
            if messages[-1]["content"] == "slow":
                entered.set()
                release.wait(10)
            return plain(messages, **kw)

        formatter.render_chat = slow
        stuck = threading.Thread(
            target=lambda: httpx.post(
                url + CHAT, json=chat(messages=[{"role": "user", "content": "slow"}]), timeout=30
            )
        )
        stuck.start()
        try:
            assert entered.wait(10)
            started = time.monotonic()
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            assert httpx.post(url + CHAT, json=chat(), timeout=5).status_code == 200
            assert time.monotonic() - started < 5
        finally:
            release.set()
            stuck.join(10)


def test_unexpected_errors_are_one_500_logged_once(base, caplog):
    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, eos_after=2))
    with serve_app(app) as url:

        def broken(messages, contexts=None):
            raise KeyError("boom")

        app.state.kvwarm.healing.heal_all = broken
        server_log = logging.getLogger("uvicorn.error")  # kvwarm serve lets it propagate
        server_log.addHandler(caplog.handler)
        try:
            with caplog.at_level(logging.ERROR):
                r = httpx.post(url + CHAT, json=chat())
        finally:
            server_log.removeHandler(caplog.handler)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
        assert len(errors) == 1, [rec.getMessage() for rec in errors]


def test_watchdog_cuts_running_requests_short_and_refuses_queued_ones():
    settings = Settings(_env_file=None, batch=1, request_timeout=0.5)
    app = create_app(settings, lambda s, r: FakeEngine(s, r, step_delay=1.0))
    with serve_app(app) as url:
        results: dict[str, httpx.Response] = {}

        def post(name: str) -> None:
            body = chat(max_tokens=50, ignore_eos=True)
            results[name] = httpx.post(url + CHAT, json=body, timeout=30)

        first = threading.Thread(target=post, args=("running",))
        first.start()
        time.sleep(0.2)
        post("queued")
        first.join(30)
        stats = httpx.get(url + "/stats").json()["requests"]
        metrics = httpx.get(url + "/metrics").text
    running, queued = results["running"], results["queued"]
    # the queued one's wait is queue time too, the longest there was (it had no stats)
    queue = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kvwarm:request_queue_time_seconds_")
        and not line.startswith("kvwarm:request_queue_time_seconds_bucket")
    }
    assert queue["kvwarm:request_queue_time_seconds_count"] == 2
    assert queue["kvwarm:request_queue_time_seconds_sum"] >= 0.5
    assert running.status_code == 200, running.text
    assert running.json()["choices"][0]["finish_reason"] == "length"  # as the seed server
    assert queued.status_code == 503 and queued.headers["retry-after"]
    assert queued.json()["error"]["code"] == "queue_timeout"
    assert stats["watchdog"] == 2 and stats["aborted"] == 2


@pytest.mark.parametrize(
    "path, body",
    [
        (CHAT, chat(max_tokens=50)),
        (MESSAGES, anthropic(max_tokens=50)),
        (RESPONSES, responses(max_output_tokens=50)),
        (COMPLETIONS, completion(max_tokens=50)),
    ],
    ids=["chat", "messages", "responses", "completions"],
)
def test_a_streamed_request_refused_before_its_headers_is_a_503(path, body):
    """Nothing was sent yet, so a queue timeout keeps its status and Retry-After,
    as unstreamed (it was an error event inside a 200: SDKs' retries never fired)."""
    settings = Settings(_env_file=None, batch=1, request_timeout=0.5)
    app = create_app(settings, lambda s, r: FakeEngine(s, r, step_delay=1.0))
    with serve_app(app) as url:
        running = threading.Thread(
            target=httpx.post,
            args=(url + CHAT,),
            kwargs={"json": chat(max_tokens=50, ignore_eos=True), "timeout": 30},
        )
        running.start()
        time.sleep(0.2)
        queued = httpx.post(url + path, json={**body, "stream": True}, timeout=30)
        running.join(30)
    assert queued.status_code == 503, queued.text
    assert queued.headers["retry-after"]
    assert "text/event-stream" not in queued.headers["content-type"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_budget_shrinks_below_while_queued_is_a_400(stream):
    """Checked at the door, then the budget shrank (an adapter mounted meanwhile):
    the queue's head could never run and held everyone behind it forever."""
    settings = Settings(_env_file=None, batch=1)
    app = create_app(settings, lambda s, r: FakeEngine(s, r, step_delay=0.3))
    results: dict[str, httpx.Response] = {}

    def post(name: str, body: dict) -> None:
        results[name] = httpx.post(url + CHAT, json=body, timeout=30)

    with serve_app(app) as url:
        posts = [
            threading.Thread(target=post, args=("running", chat(max_tokens=4, ignore_eos=True))),
            threading.Thread(
                target=post, args=("queued", chat(max_tokens=4 * KV_ALLOCATION_STEP, stream=stream))
            ),
        ]
        for thread in posts:
            thread.start()
            time.sleep(0.1)
        # room for one allocation step of KV is left: the running request's, not the queued one's
        admission = app.state.kvwarm.service.scheduler.admission
        b = admission.budget
        room = b.sequence_bytes(KV_ALLOCATION_STEP)
        admission.budget = replace(b, adapter_bytes=b.adapter_bytes + b.kv_budget_bytes - room)
        for thread in posts:
            thread.join(30)
        after = httpx.post(url + CHAT, json=chat(max_tokens=2), timeout=30)
    queued = results["queued"]
    assert queued.status_code == 400, queued.text
    assert queued.json()["error"]["code"] == "context_over_budget"
    assert results["running"].status_code == 200
    assert after.status_code == 200  # nobody is stuck behind it


def test_a_watchdog_cut_delivers_what_was_generated_and_stores_nothing():
    """As the seed server: finish length with the text so far, streamed or not; the
    reply is not remembered for healing (a normal reply is: the control)."""
    settings = Settings(_env_file=None, request_timeout=1.0)
    app = create_app(settings, lambda s, r: FakeEngine(s, r, step_delay=0.2))
    with serve_app(app) as url:
        healing = app.state.kvwarm.healing
        whole = httpx.post(url + CHAT, json=chat(max_tokens=2), timeout=30)
        assert whole.status_code == 200 and whole.json()["choices"][0]["finish_reason"] == "length"
        remembered = len(healing)
        assert remembered == 1  # the control: an ordinary reply is remembered
        cut = httpx.post(url + CHAT, json=chat(max_tokens=500, ignore_eos=True), timeout=30)
        with httpx.stream(
            "POST", url + CHAT, json=chat(max_tokens=500, ignore_eos=True, stream=True), timeout=30
        ) as r:
            events = [
                json.loads(line[6:])
                for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
            assert r.status_code == 200
        assert len(healing) == remembered
    choice = cut.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].startswith("w0 w1 w2 ")  # ~5 steps in 1 s
    assert cut.json()["usage"]["completion_tokens"] >= 3
    streamed = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
    )
    assert streamed.startswith("w0 w1 w2 ")
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"


@pytest.mark.parametrize(
    "path, body, ends",
    [
        (CHAT, chat(), "data: [DONE]"),
        (MESSAGES, anthropic(), "event: error"),
        (RESPONSES, responses(), "response.failed"),
        (COMPLETIONS, completion(), "data: [DONE]"),
    ],
)
def test_a_reply_whose_output_cannot_be_parsed_fails_alone_with_an_error(
    base, monkeypatch, path, body, ends
):
    """A fault in the output parser (no known input causes one) ends that reply
    with the dialect's error, streamed or not: never a cut connection."""

    def broken(self, text):
        raise RuntimeError("parser fault")

    monkeypatch.setattr("app.protocol.output_parser.OutputParser.feed", broken)
    r = httpx.post(base + path, json=body)
    assert r.status_code == 500 and "could not be parsed" in r.text, r.text
    r = httpx.post(base + path, json={**body, "stream": True})
    assert "could not be parsed" in r.text and ends in r.text, r.text
    monkeypatch.undo()
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.post(base + path, json=body).status_code == 200


def test_a_fault_ending_requests_the_scheduler_let_go_still_ends_their_streams():
    """The watchdog's plan drops a late running request and a late queued one from
    the scheduler before their final outputs exist: a fault while cutting one
    short killed the engine, whose death fails only what the scheduler still
    holds, and both streams waited for ever."""
    import asyncio

    from scheduler.request import Request
    from scheduler.scheduler import Scheduler
    from scheduler.service import GenerationService
    from scheduler.streams import OutputRouter
    from tests.helpers.fake_engine import FakeEngine

    async def run() -> list:
        scheduler = Scheduler(None, max_running=1, max_queue=8, request_timeout_s=0.3)
        router = OutputRouter(asyncio.get_running_loop())
        engine = FakeEngine(scheduler, router, step_delay=0.5)  # both late at one schedule()

        def broken_cut_short(request_id: str):
            raise RuntimeError("cut_short failed")

        engine.fake.cut_short = broken_cut_short
        service = GenerationService(scheduler, router, engine)
        engine.start()
        assert engine.wait_ready(5)
        try:
            running = service.submit(Request([1, 2, 3], 1000))
            await asyncio.sleep(0.05)
            queued = service.submit(Request([1, 2, 3], 1000))

            async def last(stream):
                outputs = [out async for out in stream]
                return outputs[-1] if outputs else None

            return await asyncio.wait_for(asyncio.gather(last(running), last(queued)), 3)
        finally:
            engine.stop()
            engine.join(5)

    finals = asyncio.run(run())
    assert all(f is not None and f.finished and f.error for f in finals)


def test_every_argument_of_render_chat_is_reserved_from_template_kwargs():
    """A client's chat_template_kwargs reach render_chat as **kwargs: one named
    like its own arguments collided there, after the request was queued."""
    import inspect

    from app.request_fields import RESERVED_TEMPLATE_KWARGS
    from engine.prompt_format import ChatFormatter

    named = inspect.signature(ChatFormatter.render_chat).parameters
    own = {n for n, p in named.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert own <= RESERVED_TEMPLATE_KWARGS


def _engine_whose_close_raises(step_delay: float):
    import asyncio

    from scheduler.scheduler import Scheduler
    from scheduler.service import GenerationService
    from scheduler.streams import OutputRouter

    router = OutputRouter(asyncio.get_running_loop())
    scheduler = Scheduler(None, max_running=2, max_queue=8)
    engine = FakeEngine(scheduler, router, step_delay=step_delay)

    def close() -> None:  # mx.synchronize on a device that just failed, a disk flush
        raise OSError("[METAL] Command buffer execution failed")

    engine.fake.close = close
    engine.start()
    assert engine.wait_ready(5)
    return engine, GenerationService(scheduler, router, engine)


def test_a_runner_that_fails_to_close_still_answers_everyone_waiting(caplog):
    """Cleanup ran runner.close() first: when it raised, a save queued for the
    engine and (on an orderly stop) every open stream were never answered."""
    import asyncio

    from scheduler.admission import EngineUnavailable
    from scheduler.request import FinishReason, Request

    async def died() -> None:
        engine, service = _engine_whose_close_raises(step_delay=0.3)
        stream = service.submit(Request([1, 2, 3], 1000))
        await stream.__anext__()  # running; the engine is inside a 0.3 s step
        saved = engine.control(lambda runner: "saved")
        engine.inject_fault(RuntimeError("device lost"))
        last = [out async for out in stream][-1]
        assert last.finish_reason is FinishReason.ERROR
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(asyncio.wrap_future(saved), 5)

    async def stopped() -> None:
        engine, service = _engine_whose_close_raises(step_delay=0.05)
        stream = service.submit(Request([1, 2, 3], 2000))
        await stream.__anext__()
        engine.stop()
        async with asyncio.timeout(5):
            last = [out async for out in stream][-1]
        assert last.finish_reason is FinishReason.ERROR and "shutting down" in last.error

    with caplog.at_level(logging.ERROR):
        asyncio.run(died())
        asyncio.run(stopped())
    assert "closing the engine's runner failed" in caplog.text


def test_an_engine_gone_before_a_request_is_queued_leaves_nothing_queued():
    """The handler read the model's name after queueing the request: an engine
    that stopped in between made it answer 503 with the request still queued,
    its stream never started and so never closed."""
    from types import SimpleNamespace

    from app.generation import Generation
    from scheduler.admission import EngineUnavailable
    from scheduler.request import Request

    submitted = []

    def gone():
        raise EngineUnavailable("The inference engine is not running: stopped")

    state = SimpleNamespace(
        settings=SimpleNamespace(strip_thinking=False),
        model_info=gone,
        service=SimpleNamespace(submit=submitted.append),
    )
    prepared = SimpleNamespace(request=Request([1, 2, 3], 8))
    with pytest.raises(EngineUnavailable):
        Generation(state, prepared, "chat")
    assert submitted == []


@asynccontextmanager
async def _fake_service(step_delay: float):
    """A batch-1 FakeEngine behind a GenerationService, on the running loop."""
    from scheduler.scheduler import Scheduler
    from scheduler.service import GenerationService
    from scheduler.streams import OutputRouter
    from tests.helpers.fake_engine import FakeEngine

    scheduler = Scheduler(None, max_running=1, max_queue=8)
    router = OutputRouter(asyncio.get_running_loop())
    engine = FakeEngine(scheduler, router, step_delay=step_delay)
    engine.start()
    engine.wait_ready(5)
    try:
        yield scheduler, engine, GenerationService(scheduler, router, engine)
    finally:
        engine.stop()
        engine.join(5)


class _Http:
    """What Generation reads of an HTTP request: a client that stays."""

    scope: dict = {}
    headers: dict = {}

    async def is_disconnected(self) -> bool:
        return False


def _observed_state(service, done: list) -> object:
    """The AppState parts a Generation uses, its observers recording each request_done."""
    from types import SimpleNamespace

    return SimpleNamespace(
        settings=SimpleNamespace(strip_thinking=False),
        model_info=lambda: SimpleNamespace(model_id="m"),
        service=service,
        obs=SimpleNamespace(request_done=lambda rec, headers: done.append(rec)),
        healing=None,
        engine=SimpleNamespace(model_info=SimpleNamespace(model_id="m")),
    )


def test_a_streamed_request_whose_body_never_starts_is_cancelled_with_its_generation():
    """start()'s read-ahead held the request's stream: a client that left before
    the response body began (Starlette never iterated it) left the request queued,
    then running for no one, its log record never written."""
    import gc
    from types import SimpleNamespace

    from app.generation import Generation
    from scheduler.request import Request

    async def scenario() -> None:
        async with _fake_service(step_delay=0.01) as (scheduler, _, service):
            blocker = service.submit(Request([1] * 5, 2000, ignore_eos=True))
            done: list = []
            prepared = SimpleNamespace(
                request=Request([2] * 5, 300, ignore_eos=True), answered=None
            )
            gen = Generation(_observed_state(service, done), prepared, "chat", _Http())
            assert await gen.start(_Http(), wait_s=0.05)  # still queued: headers go out
            assert scheduler.stats().waiting == 1
            del gen
            gc.collect()
            async with asyncio.timeout(5):
                while scheduler.stats().waiting:
                    await asyncio.sleep(0.02)
            assert scheduler.stats().aborted_total == 1
            await blocker.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("client_left_in_start", [False, True])
def test_a_streamed_request_whose_body_never_starts_is_observed_once(client_left_in_start):
    """Aborted by the finalizer, it ended unseen: no request_success{abort}, no
    client_disconnects, no log line, no span. One that start() already closed (its
    client left while it waited) is not observed a second time when collected."""
    import gc
    from types import SimpleNamespace

    from app.generation import Generation
    from scheduler.request import Request

    class Leaving(_Http):
        async def is_disconnected(self) -> bool:
            return client_left_in_start

    async def scenario() -> None:
        async with _fake_service(step_delay=0.01) as (scheduler, _, service):
            blocker = service.submit(Request([1] * 5, 2000, ignore_eos=True))
            done: list = []
            prepared = SimpleNamespace(request=Request([2] * 5, 50, ignore_eos=True), answered=None)
            gen = Generation(_observed_state(service, done), prepared, "chat", _Http())
            assert await gen.start(Leaving(), wait_s=0.3) is not client_left_in_start
            del gen
            gc.collect()
            async with asyncio.timeout(5):
                while not done or scheduler.stats().waiting:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # a second observation would have come by now
            assert [(r.finish, r.disconnected) for r in done] == [("abort", True)]
            assert scheduler.stats().aborted_total == 1
            await blocker.aclose()

    asyncio.run(scenario())


def test_a_body_that_never_starts_after_its_first_output_is_recorded_with_it():
    """The read-ahead had its first output (the engine started the request, its
    cache report in it) when the generation went: the record was made without it,
    as a request that never reached the engine (no cache report, all its time
    counted as queueing)."""
    import gc
    from types import SimpleNamespace

    from app.generation import Generation
    from scheduler.request import Request

    async def scenario() -> None:
        async with _fake_service(step_delay=0.01) as (_, _, service):
            blocker = service.submit(Request([1] * 5, 5, ignore_eos=True))
            done: list = []
            prepared = SimpleNamespace(
                request=Request([2] * 5, 300, ignore_eos=True), answered=None
            )
            gen = Generation(_observed_state(service, done), prepared, "chat", _Http())
            assert await gen.start(_Http(), wait_s=0.01)  # still queued: headers go out
            assert gen.outcome.cache is None
            pending = gen._pending  # noqa: SLF001 - the read-ahead, read by no body
            async with asyncio.timeout(5):
                while not pending.done():  # the blocker ended: this one started
                    await asyncio.sleep(0.01)
            del gen
            gc.collect()
            async with asyncio.timeout(5):
                while not done:
                    await asyncio.sleep(0.02)
            [record] = done
            assert (record.finish, record.disconnected) == ("abort", True)
            assert record.cache is not None  # the engine's report, from the first output
            assert record.waited_s is None  # it ran: its wait was not all queueing
            await blocker.aclose()

    asyncio.run(scenario())


def test_control_operations_run_a_few_per_step_and_queue_to_a_bound():
    """Every /v1/conv_kv load and adapter call ran before the next decode step: a
    flood of them from one client stalled every stream's tokens, and their queue
    had no end."""
    from engine.engine_thread import CONTROLS_PER_STEP, MAX_PENDING_CONTROLS
    from scheduler.admission import EngineUnavailable
    from scheduler.request import Request

    async def scenario() -> None:
        async with _fake_service(step_delay=0.002) as (_, engine, service):
            stream = service.submit(Request([1] * 5, 2000, ignore_eos=True))
            await stream.__anext__()  # decoding
            held = threading.Event()
            blocker = engine.control(lambda runner: held.wait(5))
            while not blocker.running():
                await asyncio.sleep(0.005)
            at_steps: list[int] = []
            queued = [
                engine.control(lambda runner: at_steps.append(engine._steps))  # noqa: SLF001
                for _ in range(MAX_PENDING_CONTROLS)
            ]
            refused = engine.control(lambda runner: None)
            with pytest.raises(EngineUnavailable) as busy:
                refused.result(1)
            assert busy.value.code == "engine_busy" and busy.value.retry_after
            held.set()
            for future in queued:
                future.result(10)
            per_step = {s: at_steps.count(s) for s in at_steps}
            assert max(per_step.values()) <= CONTROLS_PER_STEP
            await stream.aclose()

    asyncio.run(scenario())


def test_a_replys_events_are_merged_once_however_often_they_are_read(monkeypatch):
    """content, tool_calls and the stop kind each read the events, and each read
    merged them all again: 5,000 calls beside text cost tens of ms on the loop."""
    import app.generation as generation
    from app.generation import Outcome
    from app.protocol.output_parser import Content
    from app.protocol.tool_formats import ToolCall

    merged: list[int] = []
    real = generation.merge
    monkeypatch.setattr(generation, "merge", lambda ev: merged.append(len(ev)) or real(ev))
    outcome = Outcome()
    for i in range(100):
        outcome.add_event(Content("a"))
        outcome.add_event(Content("b"))
        outcome.add_event(ToolCall("f", "{}", f"call_{i}"))
    assert len(outcome.tool_calls) == 100 and outcome.content == "ab" * 100
    assert outcome.events and merged == [300]
    outcome.add_event(Content("c"))
    assert outcome.content.endswith("c") and len(merged) == 2


def test_finalising_a_response_reads_the_events_a_bounded_number_of_times(monkeypatch):
    """Each message item's status asked the stop kind, which copied and scanned
    every event: items x events on the event loop for a reply of many calls."""
    from app.generation import Outcome
    from app.openai_responses import _apply, _finalise, _Items
    from app.protocol.output_parser import Content
    from app.protocol.tool_formats import ToolCall
    from scheduler.request import FinishReason

    done = Outcome()
    for i in range(200):
        done.add_event(Content(f"t{i} "))
        done.add_event(ToolCall("f", "{}", f"call_{i}"))
    done.finish_reason = FinishReason.STOP
    items = _Items()
    for event in done.events:
        _apply(items, event)
    reads = []
    real = Outcome.events
    monkeypatch.setattr(Outcome, "events", property(lambda o: reads.append(1) or real.fget(o)))
    response = _finalise({}, done, items)
    assert len(reads) <= 1
    messages = [i for i in response["output"] if i["type"] == "message"]
    assert len(messages) == 200 and {m["status"] for m in messages} == {"completed"}
    assert response["status"] == "completed" and done.stop_kind == "tool_calls"
