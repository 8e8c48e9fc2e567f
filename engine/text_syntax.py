"""What the tokenizer and chat template say about reasoning and tool-call markup."""

from __future__ import annotations

import re

from scheduler.contracts import TextSyntax

# template variables kvwarm sets when the template reads them
KNOWN_VARS = ("enable_thinking", "preserve_thinking", "reasoning_effort", "thinking")


def _reads(template: str, name: str) -> bool:
    """Whether the template reads the variable ``name`` (not ``enable_thinking``
    for ``thinking``, nor a message's ``.thinking`` field or a quoted word)."""
    return re.search(rf"(?<![\w.'\"]){name}(?![\w'\"])", template) is not None


def probe_syntax(tokenizer) -> TextSyntax:
    """From an mlx-lm TokenizerWrapper. Models without think tokens still get the
    plain-text ``<think>`` tags: small models write them as text when prompted."""
    think_start = getattr(tokenizer, "think_start", None) or "<think>"
    think_end = getattr(tokenizer, "think_end", None) or "</think>"
    parser = getattr(tokenizer, "tool_parser", None)
    family = parser.__module__.rsplit(".", 1)[-1] if parser is not None else None
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: their texts, not their names
        template = list(template.values())
    text = template if isinstance(template, str) else " ".join(map(str, template or ()))
    return TextSyntax(
        think_start=think_start,
        think_end=think_end,
        tool_family=family,
        tool_call_start=getattr(tokenizer, "tool_call_start", None) if family else None,
        tool_call_end=getattr(tokenizer, "tool_call_end", None) if family else None,
        template_vars=frozenset(v for v in KNOWN_VARS if _reads(text, v)),
    )
