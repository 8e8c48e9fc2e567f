"""The three dialects on the real model, through the official SDKs: every response
and event parses, and a multi-turn conversation reuses the same KV whichever
dialect carries it."""

from __future__ import annotations

import uuid

import anthropic
import openai

RULES = "You are a terse assistant. Answer in one short sentence. " * 6
TURNS = ["Name a colour.", "Name a fruit.", "Name an animal."]
MAX = 16


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=120)


def _anthropic(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="k", max_retries=0, timeout=120)


def _chat_turns(base: str, system: str) -> list[tuple[int, int, int]]:
    client, messages, out = _openai(base), [{"role": "system", "content": system}], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(
            model="m", messages=messages, max_tokens=MAX, temperature=0
        )
        u = r.usage
        out.append((u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens))
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return out


def _messages_turns(base: str, system: str) -> list[tuple[int, int, int]]:
    client, messages, out = _anthropic(base), [], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        r = client.messages.create(
            model="m",
            system=system,
            messages=messages,
            max_tokens=MAX,
            extra_body={"temperature": 0},
        )
        u = r.usage
        out.append(
            (u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens, u.output_tokens)
        )
        messages.append({"role": "assistant", "content": [b.model_dump() for b in r.content]})
    return out


def _responses_turns(base: str, system: str) -> list[tuple[int, int, int]]:
    client, previous, out = _openai(base), None, []
    for i, text in enumerate(TURNS):
        items = [{"role": "system", "content": system}] if i == 0 else []
        r = client.responses.create(
            model="m",
            input=items + [{"role": "user", "content": text}],
            previous_response_id=previous,
            max_output_tokens=MAX,
            temperature=0,
        )
        u = r.usage
        out.append((u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens))
        previous = r.id
    return out


def test_prefix_cache_hits_the_same_across_dialects(server):
    tag = uuid.uuid4().hex[:8]
    runs = {
        "chat": _chat_turns(server, f"[{tag}-c] {RULES}"),
        "messages": _messages_turns(server, f"[{tag}-m] {RULES}"),
        "responses": _responses_turns(server, f"[{tag}-r] {RULES}"),
    }
    for dialect, turns in runs.items():
        assert turns[0][1] == 0, (dialect, turns)  # a fresh tag: nothing to reuse
        for (prev_prompt, _, prev_out), (prompt, hit, _) in zip(turns, turns[1:]):
            # everything the previous turn left in KV: its prompt and its reply
            assert hit >= prev_prompt + prev_out - 2, (dialect, turns)
            assert hit < prompt, (dialect, turns)
    ratios = {d: sum(h for _, h, _ in t[1:]) / sum(p for p, _, _ in t[1:]) for d, t in runs.items()}
    assert max(ratios.values()) - min(ratios.values()) < 0.05, ratios


def test_openai_sdk_chat_with_tools_and_streaming(server):
    client = _openai(server)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(
        model="m", messages=messages, tools=tools, max_tokens=12, temperature=0
    )
    assert whole.choices[0].finish_reason in ("stop", "length", "tool_calls")
    streamed = ""
    for chunk in client.chat.completions.create(
        model="m", messages=messages, tools=tools, max_tokens=12, temperature=0, stream=True
    ):
        if chunk.choices:
            streamed += chunk.choices[0].delta.content or ""
    assert streamed == (whole.choices[0].message.content or "")


def test_openai_sdk_responses_stream_and_chain(server):
    client = _openai(server)
    events = list(
        client.responses.create(
            model="m", input="Say hi.", max_output_tokens=8, temperature=0, stream=True
        )
    )
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert final.status in ("completed", "incomplete")
    follow = client.responses.create(
        model="m", input="Again.", previous_response_id=final.id, max_output_tokens=8, temperature=0
    )
    assert follow.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens


def test_anthropic_sdk_streaming_tool_round_trip_and_count_tokens(server):
    client = _anthropic(server)
    tools = [
        {
            "name": "lookup",
            "description": "Look up",
            "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
        }
    ]
    history = [
        {"role": "user", "content": "Look up the capital of France."},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "lookup",
                    "input": {"q": "capital of France"},
                }
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Paris"}],
        },
    ]
    with client.messages.stream(
        model="m", max_tokens=12, messages=history, tools=tools, extra_body={"temperature": 0}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert text == "".join(b.text for b in final.content if b.type == "text")
    counted = client.messages.count_tokens(model="m", messages=history, tools=tools)
    assert counted.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens
