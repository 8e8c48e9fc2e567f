"""The chat template rendered as the tokenizer's ``apply_chat_template`` renders
it, without that call's per-message copies.

A new turn renders the whole conversation again (templates may rewrite earlier
turns), and for plain JSON messages most of ``apply_chat_template``'s time is
not jinja: transformers copies every message twice (objects to dicts, then to
plain JSON types) and aliases reasoning fields, 35% of a warm turn of a
1,000-message conversation. Our messages are plain JSON already, so the same
compiled template is rendered directly after one shallow pass that does what
those copies change for such data: keys whose value is None dropped, the
reasoning aliased.

The direct render is trusted for a tokenizer only after check chats render the
same both ways under several kwargs (none, tools, the thinking switch, a custom
variable); a tokenizer with its own renderer, any disagreement, kwargs that
``apply_chat_template`` treats itself, or a value that is not plain JSON go
through ``apply_chat_template`` as before.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("kvwarm.prompt")

try:  # transformers' own cached compile: the same sandbox, filters and globals
    from transformers.utils.chat_template_utils import _compile_jinja_template
except ImportError:  # pragma: no cover - another transformers: apply_chat_template only
    _compile_jinja_template = None

# where transformers looks for a message's reasoning, in its order
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_PLAIN = (str, int, float, bool)

# chats the direct render must reproduce under every CHECK_KWARGS set before a
# tokenizer trusts it: None content, tool calls and results, reasoning under each
# name, a system turn
CHECK_CHATS: tuple[tuple[dict[str, Any], ...], ...] = (
    (
        {"role": "system", "content": "Be terse.", "name": None},
        {"role": "user", "content": "Read a.txt"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should read it.",
            "tool_calls": [
                {"type": "function", "function": {"name": "read", "arguments": {"p": "a"}}}
            ],
        },
        {"role": "tool", "content": "hello", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It says hello.", "thinking": "done"},
        {"role": "user", "content": "And b?"},
    ),
    (
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning": "greet"},
        {"role": "user", "content": "Bye"},
    ),
    (  # reasoning after the last query: what templates that drop older reasoning keep
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "thinking": "greet", "reasoning": "x"},
    ),
)
CHECK_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Reads a file.",
            "parameters": {"type": "object", "properties": {"p": {"type": "string"}}},
        },
    }
]
CHECK_KWARGS: tuple[dict[str, Any], ...] = (
    {},
    {"tools": CHECK_TOOLS},
    {"enable_thinking": False},
    {"enable_thinking": True, "tools": CHECK_TOOLS, "custom_flag": [1, {"a": None}]},
)


class NotPlain(Exception):
    """A message value that transformers would convert (an object, a str subclass)."""


class ChatTemplate:
    """``render(messages, add_generation_prompt, kwargs) -> text`` for an mlx-lm
    TokenizerWrapper; thread-safe (compiled jinja templates render concurrently)."""

    def __init__(self, tokenizer: Any):
        self._wrapper = tokenizer
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._thinking_kwarg = getattr(tokenizer, "_thinking_kwarg", None)
        self._reserved: frozenset[str] = frozenset()
        self._special: dict[str, Any] = {}
        self.direct = (
            _compile_jinja_template is not None
            and getattr(tokenizer, "_chat_template", None) is None  # mlx-lm's own renderer
            and getattr(tokenizer, "has_chat_template", False)
            and isinstance(self._thinking_kwarg, str)
            and callable(getattr(self._hf, "get_chat_template", None))
        )
        if self.direct:
            params = inspect.signature(self._hf.apply_chat_template).parameters.values()
            self._reserved = frozenset(
                p.name for p in params if p.kind is not p.VAR_KEYWORD and p.name != "tools"
            )
            self._special = dict(self._hf.special_tokens_map)
            self.direct = self._agrees()

    def __call__(
        self, messages: Sequence[dict[str, Any]], generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        if self.direct and self._reserved.isdisjoint(kwargs):
            try:
                return self._render_direct(messages, generation_prompt, kwargs)
            except NotPlain:
                pass
        return self._render_library(messages, generation_prompt, kwargs)

    def _render_library(
        self, messages: Sequence[dict[str, Any]], generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        return self._wrapper.apply_chat_template(
            list(messages), add_generation_prompt=generation_prompt, tokenize=False, **kwargs
        )

    def _render_direct(
        self, messages: Sequence[dict[str, Any]], generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        chat = [_plain_message(m) for m in messages]
        variables = dict(kwargs)
        # what mlx-lm's TokenizerWrapper.apply_chat_template does with the thinking switch
        thinking = self._thinking_kwarg
        if thinking != "enable_thinking" and "enable_thinking" in variables:
            variables[thinking] = variables.pop("enable_thinking")
        variables.setdefault(thinking, self._wrapper.has_thinking)
        tools = variables.pop("tools", None)
        _check_plain(variables)
        _check_plain(tools)
        template = _compile_jinja_template(self._hf.get_chat_template(None, tools))
        return template.render(
            messages=chat,
            tools=tools,
            documents=None,
            add_generation_prompt=generation_prompt,
            **{**self._special, **variables},
        )

    def _agrees(self) -> bool:
        """Whether the direct render gives what apply_chat_template gives on every
        check chat under every check kwargs set, with and without the generation
        prompt (samples the template refuses are skipped; at least one must render)."""
        rendered = 0
        for kwargs in CHECK_KWARGS:
            for chat in CHECK_CHATS:
                for prompt in (True, False):
                    try:
                        expected = self._render_library(chat, prompt, kwargs)
                    except Exception:  # noqa: BLE001 - a template that refuses this sample
                        continue
                    try:
                        got: str | None = self._render_direct(chat, prompt, kwargs)
                    except Exception:  # noqa: BLE001
                        got = None
                    if got != expected:
                        log.info(
                            "chat template rendered through apply_chat_template: a direct "
                            "render differs from it on a check chat"
                        )
                        return False
                    rendered += 1
        return rendered > 0


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """What transformers' copies make of a plain JSON message: None-valued keys
    dropped, the reasoning under every name templates read."""
    if type(message) is not dict:
        raise NotPlain(type(message).__name__)
    _check_plain(message)
    out = {key: value for key, value in message.items() if value is not None}
    reasoning = next((out[key] for key in REASONING_FIELDS if key in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _check_plain(value: Any) -> None:
    """Raise NotPlain for anything but JSON's types (exact: subclasses and objects
    are what transformers would convert)."""
    kind = type(value)
    if kind in _PLAIN or value is None:
        return
    if kind is list:
        for item in value:
            _check_plain(item)
    elif kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise NotPlain("a key that is not a str")
            _check_plain(item)
    else:
        raise NotPlain(kind.__name__)
