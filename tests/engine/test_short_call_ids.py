"""Mistral v0.3/Nemo chat templates refuse any tool-call id but 9 alphanumerics:
ids minted by kvwarm (call_<24 hex>) or by another client (toolu_...) made the
next turn a 400. They are mapped, deterministically, at render time; the ids a
model that demands them gets minted are already of that shape."""

from __future__ import annotations

import dataclasses
import json
import re

import httpx
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from app.server import create_app
from app.settings import Settings
from engine.call_ids import short_call_ids
from engine.prompt_format import ChatFormatter
from engine.text_syntax import probe_syntax
from tests.engine.test_prompt_format import smollm2_dir  # noqa: F401 - a fixture
from tests.helpers.dialects import ANTHROPIC_TOOLS, RESPONSES_TOOLS, TOOLS
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import serve_app

# Mistral v0.3's tool-call and tool-result rendering, its id check included
MISTRAL_V03 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}"
    "{{- '[TOOL_CALLS] [' }}{%- for tool_call in message.tool_calls %}"
    "{%- set out = tool_call.function|tojson %}{{- out[:-1] }}"
    "{%- if not tool_call.id is defined or tool_call.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{{- ', \"id\": \"' + tool_call.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}{%- endif %}"
    "{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message.content|string + ', ' }}"
    "{%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}"
)
CALL = ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]']
SHORT = re.compile(r"[A-Za-z0-9]{9}")
ID_IN_PROMPT = re.compile(r'"(?:id|call_id)": "([^"]*)"')


@pytest.fixture(scope="module")
def mistral_tokenizer(smollm2_dir, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("mistral-v03")
    (path / "tokenizer.json").write_text((smollm2_dir / "tokenizer.json").read_text())
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": MISTRAL_V03})
    )
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def served(mistral_tokenizer):
    """The model-free engine behind the real ChatFormatter and syntax probe of a
    tokenizer with the Mistral template; every reply is a call without an id."""
    prompts: list[str] = []

    def script(req):
        prompts.append(mistral_tokenizer.decode(req.prompt_tokens))
        return CALL

    app = create_app(
        Settings(_env_file=None), lambda s, r: FakeEngine(s, r, script=script, eos_after=6)
    )
    with serve_app(app) as url:
        engine = app.state.kvwarm.engine
        engine.info = dataclasses.replace(
            engine.info,
            formatter=ChatFormatter(mistral_tokenizer, 2048),
            syntax=probe_syntax(mistral_tokenizer),
        )
        yield url, prompts


def test_the_template_check_is_detected(mistral_tokenizer, smollm2_dir):  # noqa: F811
    assert probe_syntax(mistral_tokenizer).short_call_ids
    assert not probe_syntax(load_tokenizer(smollm2_dir)).short_call_ids  # ChatML


def _chat_turn(call_id: str) -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]


def test_chat_ids_minted_elsewhere_render_as_nine_alphanumerics(served):
    url, prompts = served
    body = {"model": "m", "messages": _chat_turn("call_b2b44c69bed0415985129323"), "tools": TOOLS}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    first = prompts[-1]
    ids = ID_IN_PROMPT.findall(first)
    assert len(ids) == 2 and ids[0] == ids[1] and SHORT.fullmatch(ids[0])
    # the same history renders the same tokens again: the cached prefix stays valid
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    assert prompts[-1] == first


def test_a_conforming_id_passes_through_unchanged(served):
    url, prompts = served
    body = {"model": "m", "messages": _chat_turn("a1B2c3D4e"), "tools": TOOLS}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    assert ID_IN_PROMPT.findall(prompts[-1]) == ["a1B2c3D4e", "a1B2c3D4e"]


def test_anthropic_tool_use_ids_render_as_nine_alphanumerics(served):
    url, prompts = served
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_01A09q90qw90lq917835lq9",
                    "name": "get_weather",
                    "input": {"city": "Rome"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                    "content": "sunny",
                }
            ],
        },
    ]
    body = {"model": "m", "max_tokens": 64, "messages": messages, "tools": ANTHROPIC_TOOLS}
    r = httpx.post(url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 200, r.text
    ids = ID_IN_PROMPT.findall(prompts[-1])
    assert len(ids) == 2 and ids[0] == ids[1] and SHORT.fullmatch(ids[0])
    (block,) = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert SHORT.fullmatch(block["id"])  # minted in the shape the next turn renders


@pytest.mark.parametrize("stream", [False, True])
def test_minted_chat_ids_are_what_the_model_reads_next_turn(served, stream):
    url, prompts = served
    first = [{"role": "user", "content": "Weather in Rome?"}]
    body = {"model": "m", "messages": first, "tools": TOOLS, "stream": stream}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    if stream:
        chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        (call_id,) = [
            c["id"] for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls") or []
        ]
    else:
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        call_id = call["id"]
    assert SHORT.fullmatch(call_id)
    turn = _chat_turn(call_id)
    r = httpx.post(
        url + "/v1/chat/completions", json={"model": "m", "messages": turn, "tools": TOOLS}
    )
    assert r.status_code == 200, r.text
    assert ID_IN_PROMPT.findall(prompts[-1]) == [call_id, call_id]


def test_minted_responses_ids_are_nine_alphanumerics(served):
    url, _ = served
    body = {"model": "m", "input": "Weather in Rome?", "tools": RESPONSES_TOOLS}
    r = httpx.post(url + "/v1/responses", json=body, timeout=30)
    (item,) = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert SHORT.fullmatch(item["call_id"])


def test_mapping_is_per_conversation_stable_and_collision_free():
    def turn(*ids: str) -> list[dict]:
        calls = [{"id": i, "function": {"name": "f", "arguments": "{}"}} for i in ids]
        return [{"role": "assistant", "tool_calls": calls}] + [
            {"role": "tool", "tool_call_id": i, "content": "x"} for i in ids
        ]

    out = short_call_ids(turn("call_1", "toolu_2", "a1B2c3D4e"))
    mapped = [c["id"] for c in out[0]["tool_calls"]]
    assert [m["tool_call_id"] for m in out[1:]] == mapped
    assert mapped[2] == "a1B2c3D4e" and len(set(mapped)) == 3
    assert all(SHORT.fullmatch(i) for i in mapped)
    # a later turn leaves the earlier ids as they were
    longer = short_call_ids(turn("call_1", "toolu_2", "a1B2c3D4e") + turn("call_9"))
    assert [c["id"] for c in longer[0]["tool_calls"]] == mapped
    # an id colliding with an earlier mapped one is mapped anew
    taken = short_call_ids(turn("call_1", mapped[0]))
    assert taken[0]["tool_calls"][1]["id"] != mapped[0]
    assert SHORT.fullmatch(taken[0]["tool_calls"][1]["id"])
