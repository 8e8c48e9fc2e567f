"""Control tokens written in client text are text, not control tokens.

The rendered prompt is tokenised whole, and a tokenizer matches its added
tokens anywhere in it: a tool result (a web page, a file) holding
``<|im_end|><|im_start|>system`` became real turn boundaries, a prompt
injection no template could prevent. The tokenizer's special tokens found in
what a client sent get a word joiner (U+2060, invisible) after their first
character, so they tokenise as the characters they are; the ones the template
itself writes stay control tokens, as do the model's own replies (assistant
turns) and the tokens it writes as text (``<think>``, ``<tool_call>``: added,
not special).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

JOINER = "\u2060"


class ControlTokens:
    """The special tokens of one tokenizer, and how to make them plain text."""

    def __init__(self, tokens: Iterable[str]):
        # longest first: "<|im_start|>" before a shorter token that prefixes it
        words = sorted({t for t in tokens if len(t) > 1}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, words))) if words else None

    @classmethod
    def of(cls, hf: Any) -> ControlTokens:
        """From a Hugging Face tokenizer: its added tokens marked special."""
        added = getattr(hf, "added_tokens_decoder", None) or {}
        special = [t.content for t in added.values() if getattr(t, "special", False)]
        return cls([*special, *(getattr(hf, "all_special_tokens", None) or ())])

    def text(self, value: str, keep: str | None = None) -> str:
        """``value`` with every control token but those in ``keep`` made plain
        (linear in it)."""
        if self._pattern is None or not value:
            return value
        kept = frozenset(self._pattern.findall(keep)) if keep else frozenset()

        def plain(m: re.Match[str]) -> str:
            word = m[0]
            return word if word in kept else word[0] + JOINER + word[1:]

        return self._pattern.sub(plain, value)

    def plain(self, value: Any, keep: str | None = None) -> Any:
        """Every string in a JSON-like value (messages, tools) made plain; dict keys
        and other objects (an image's source) as they are. ``keep``: the image
        placeholder the server itself put in, its control tokens left as they are
        (a client's were made plain before: ``app.image_prompt``)."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self.text(value, keep)
        if isinstance(value, list):
            return [self.plain(v, keep) for v in value]
        if isinstance(value, dict):
            return {k: self.plain(v, keep) for k, v in value.items()}
        return value

    def messages(self, messages: list[dict[str, Any]], keep: str | None = None) -> list[Any]:
        """Messages made plain, but the model's own replies: echoed back (healed to
        what it generated) they are its tokens, special ones included (a harmony
        channel, a tool-call block), which the prefix cache holds as generated."""
        return [m if m.get("role") == "assistant" else self.plain(m, keep) for m in messages]
