"""Consecutive Anthropic turns of one role are joined in one pass: the old pairwise
merge rebuilt the whole joined text for every turn (16k turns of 1,000 characters
held the event loop for 52 s). Shown by equality with the pairwise semantics and
by counting what the merge reads, never by timing."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import app.anthropic_messages as am
from app.anthropic_schemas import CountTokensRequest

MERGED_KEYS = ("content", "reasoning_content", "tool_calls")


def pairwise(messages: list[dict[str, Any]], final: list[bool]) -> list[dict[str, Any]]:
    """The former semantics: fold each turn into the one before it."""
    out: list[dict[str, Any]] = []
    for message, is_final in zip(messages, final, strict=True):
        last = out[-1] if out else None
        prefill = is_final and message["role"] == "assistant"
        if (
            last is not None
            and not prefill
            and last["role"] == message["role"] in ("user", "assistant")
        ):
            a, b = last.get("content") or "", message.get("content") or ""
            if isinstance(a, str) and isinstance(b, str):
                last["content"] = "\n".join(t for t in (a, b) if t)
            else:
                last["content"] = am._as_parts(a) + am._as_parts(b)
            reasoning = "\n".join(
                t for t in (last.get("reasoning_content"), message.get("reasoning_content")) if t
            )
            if reasoning:
                last["reasoning_content"] = reasoning
            if message.get("tool_calls"):
                last["tool_calls"] = [*last.get("tool_calls", ()), *message["tool_calls"]]
        else:
            out.append(dict(message))
    return out


def reference(body: CountTokensRequest) -> list[dict[str, Any]]:
    system = am._system_text(body.system)
    flat: list[dict[str, Any]] = [] if system is None else [{"role": "system", "content": system}]
    final = [False] * len(flat)
    for i, message in enumerate(body.messages):
        translated = am._translate(message, f"messages.{i}.content")
        flat += translated
        final += [i == len(body.messages) - 1] * len(translated)
    return pairwise(flat, final)


_text = st.sampled_from(["", "a", "b c", "\n"])
_image = st.just({"type": "image", "source": {"type": "base64", "data": "QQ=="}})
_user_block = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, _text),
    _image,
    st.builds(lambda t: {"type": "tool_result", "tool_use_id": "t", "content": t}, _text),
)
_assistant_block = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, _text),
    st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "s"}, _text),
    st.just({"type": "tool_use", "id": "t", "name": "f", "input": {}}),
)
_message = st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, _text),
    st.builds(lambda b: {"role": "user", "content": b}, st.lists(_user_block, max_size=3)),
    st.builds(lambda t: {"role": "assistant", "content": t}, _text),
    st.builds(
        lambda b: {"role": "assistant", "content": b}, st.lists(_assistant_block, max_size=3)
    ),
    st.builds(lambda t: {"role": "system", "content": t}, _text),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_message, min_size=1, max_size=12), st.sampled_from([None, "sys"]))
def test_joined_turns_equal_the_pairwise_merge(messages: list[dict[str, Any]], system) -> None:
    body = CountTokensRequest.model_validate({"messages": messages, "system": system})
    assert am.template_messages(body) == reference(body)


class CountingTurn(dict):
    """A translated turn that tallies the length of each merged field read from it."""

    read = 0

    def _tally(self, key: str, value: Any) -> Any:
        if key in MERGED_KEYS and value is not None:
            CountingTurn.read += len(value)
        return value

    def __getitem__(self, key: str) -> Any:
        return self._tally(key, super().__getitem__(key))

    def get(self, key: str, default: Any = None) -> Any:
        return self._tally(key, super().get(key, default))


@pytest.mark.parametrize(
    "turn",
    [
        {"role": "user", "content": "x" * 100},
        {
            "role": "user",
            "content": [{"type": "image", "source": {"type": "base64", "data": "QQ=="}}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "r" * 50, "signature": "s"},
                {"type": "text", "text": "x" * 50},
                {"type": "tool_use", "id": "t", "name": "f", "input": {}},
            ],
        },
    ],
)
def test_a_run_of_turns_is_read_a_bounded_number_of_times(monkeypatch, turn) -> None:
    """Each turn's text, reasoning and calls are read at most twice, however long
    the run: a merge that rebuilds the joined text per turn reads it n times."""
    given_size = 0
    translate = am._translate

    def counted(message, where):
        nonlocal given_size
        out = [CountingTurn(m) for m in translate(message, where)]
        given_size += sum(len(dict.get(m, k) or ()) for m in out for k in MERGED_KEYS)
        return out

    monkeypatch.setattr(am, "_translate", counted)
    CountingTurn.read = 0
    body = CountTokensRequest.model_validate(
        {"messages": [turn] * 300 + [{"role": "user", "content": "q"}]}
    )
    out = am.template_messages(body)
    assert CountingTurn.read <= 2 * given_size
    assert len(out) in (1, 2)
