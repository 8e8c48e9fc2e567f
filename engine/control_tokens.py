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
# a trie of tokens: next character -> its node ("": a token ends here)
Trie = dict[str, "Trie"]


class ControlTokens:
    """The special tokens of one tokenizer, and how to make them plain text."""

    def __init__(self, tokens: Iterable[str]):
        words = {t for t in tokens if len(t) > 1}
        # a trie, not one alternative per token: Python's engine tried all ~1000 of
        # Mistral Tekken's <SPECIAL_n> at every "<" (1 MB of HTML: 1.15 s holding
        # the GIL); a trie's branches begin with distinct characters, so it follows
        # one per character. Greedy: the longest token at a position, as before
        self.pattern = re.compile(trie_pattern(words)) if words else None

    @classmethod
    def of(cls, hf: Any) -> ControlTokens:
        """From a Hugging Face tokenizer: its added tokens marked special."""
        added = getattr(hf, "added_tokens_decoder", None) or {}
        special = [t.content for t in added.values() if getattr(t, "special", False)]
        return cls([*special, *(getattr(hf, "all_special_tokens", None) or ())])

    def text(self, value: str, keep: str | None = None) -> str:
        """``value`` with every control token but those in ``keep`` made plain
        (linear in it)."""
        if self.pattern is None or not value:
            return value
        kept = frozenset(self.pattern.findall(keep)) if keep else frozenset()

        def plain(m: re.Match[str]) -> str:
            word = m[0]
            return word if word in kept else word[0] + JOINER + word[1:]

        return self.pattern.sub(plain, value)

    def plain(self, value: Any, keep: str | None = None) -> Any:
        """Every string in a JSON-like value (messages, tools) made plain; dict keys
        and other objects (an image's source) as they are. ``keep``: the image
        placeholder the server itself put in, its control tokens left as they are
        (a client's were made plain before: ``app.image_prompt``)."""
        if self.pattern is None:
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


def trie_pattern(words: Iterable[str]) -> str:
    """A regex matching any of ``words``, the longest where several match: their
    trie, each node an alternation of distinct next characters, and optional
    where a word ends there (greedy: the longer word is tried first)."""
    root: Trie = {}
    for word in words:
        node = root
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # a word ends here
    return _node_pattern(root)


def _node_pattern(node: Trie) -> str:
    chain = []  # characters that only lead on (one next character, no word ending)
    while len(node) == 1 and "" not in node:
        ((char, node),) = node.items()
        chain.append(char)
    branches = [re.escape(char) + _node_pattern(child) for char, child in node.items() if char]
    body = "(?:" + "|".join(branches) + ")" if len(branches) > 1 else "".join(branches)
    if body and "" in node:
        body = f"(?:{body})?"
    return re.escape("".join(chain)) + body
