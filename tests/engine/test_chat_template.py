"""ChatTemplate renders exactly what the tokenizer's apply_chat_template renders,
on every test template, for random conversations with tools, reasoning, None
values and the thinking switch; and uses apply_chat_template itself whenever it
cannot be sure of that."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine import chat_template
from engine.chat_template import ChatTemplate
from tests.engine.test_prompt_format import (  # noqa: F401 - fixtures
    EXAMPLES,
    TOOLS,
    conversations,
    smollm2_dir,
    tokenizers,
)

ALL_TEMPLATES = ("smollm2", "qwen3_like", "plain", "indexed", "three", "qwen3_real_rule")


def library(tokenizer, messages, prompt, kwargs):
    return tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=prompt, tokenize=False, **kwargs
    )


def _with_nones(messages: list[dict], reasoning_key: str) -> list[dict]:
    """The same chat as an OpenAI client may send it: None fields, reasoning under
    another name."""
    out = []
    for m in messages:
        m = {**m, "name": None}
        if "reasoning_content" in m:
            m[reasoning_key] = m.pop("reasoning_content")
        if m.get("tool_calls") and not m.get("content"):
            m["content"] = None
        out.append(m)
    return out


@pytest.mark.parametrize("name", ALL_TEMPLATES)
@EXAMPLES
@given(
    conversation=conversations,
    tools=st.booleans(),
    thinking=st.sampled_from([None, True, False]),
    reasoning_key=st.sampled_from(chat_template.REASONING_FIELDS),
    prompt=st.booleans(),
)
def test_direct_render_equals_apply_chat_template(
    tokenizers,  # noqa: F811 - the fixture
    name,
    conversation,
    tools,
    thinking,
    reasoning_key,
    prompt,
):
    tokenizer = tokenizers[name]
    template = ChatTemplate(tokenizer)
    assert template.direct  # every test template passes the check
    messages = _with_nones(conversation, reasoning_key)
    kwargs: dict = {"tools": TOOLS} if tools else {}
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    try:
        expected = library(tokenizer, messages, prompt, kwargs)
    except Exception as exc:  # noqa: BLE001 - a template that refuses this chat
        with pytest.raises(type(exc)):
            template(messages, prompt, kwargs)
        return
    assert template(messages, prompt, kwargs) == expected


class Text(str):
    pass


@pytest.mark.parametrize(
    "odd",
    [
        {"role": "user", "content": Text("a str subclass")},
        {"role": "user", "content": "x", "extra": ("a", "tuple")},
        {"role": "user", "content": "x", "meta": object()},
    ],
)
def test_values_that_are_not_plain_json_go_through_apply_chat_template(tokenizers, odd):  # noqa: F811
    tokenizer = tokenizers["smollm2"]
    template = ChatTemplate(tokenizer)
    calls = []
    template._render_library = lambda *a: calls.append(a) or library(tokenizer, *a)
    messages = [{"role": "system", "content": "s"}, odd]
    assert template(messages, True, {}) == library(tokenizer, messages, True, {})
    assert calls


def test_kwargs_apply_chat_template_handles_itself_go_through_it(tokenizers):  # noqa: F811
    tokenizer = tokenizers["smollm2"]
    template = ChatTemplate(tokenizer)
    calls = []
    template._render_library = lambda *a: calls.append(a) or library(tokenizer, *a)
    messages = [{"role": "user", "content": "hi"}]
    template(messages, True, {"documents": [{"title": "t", "text": "x"}]})
    assert calls
    calls.clear()
    template(messages, True, {"custom_flag": 1})
    assert not calls


def test_a_direct_render_that_disagrees_is_never_trusted(tokenizers, monkeypatch):  # noqa: F811
    """Without the reasoning aliasing, the Qwen3-like template (which reads
    reasoning_content) renders the check chats differently: the tokenizer keeps
    apply_chat_template, and its output stays exact."""
    monkeypatch.setattr(chat_template, "REASONING_FIELDS", ())
    tokenizer = tokenizers["qwen3_like"]
    template = ChatTemplate(tokenizer)
    assert not template.direct
    chat = list(chat_template.CHECK_CHATS[-1])
    assert template(chat, True, {}) == library(tokenizer, chat, True, {})


def test_a_tokenizer_with_its_own_renderer_keeps_it(tokenizers):  # noqa: F811
    tokenizer = tokenizers["smollm2"]

    class Wrapped:
        _chat_template = staticmethod(lambda *a, **k: "custom")
        has_chat_template = True

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    assert not ChatTemplate(Wrapped()).direct
