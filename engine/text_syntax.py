"""What the tokenizer and chat template say about reasoning and tool-call markup."""

from __future__ import annotations

import re
from typing import Any

from scheduler.contracts import TextSyntax

# template variables kvwarm sets when the template reads them
KNOWN_VARS = ("enable_thinking", "preserve_thinking", "reasoning_effort", "thinking")
# a template's check that tool-call ids are 9 characters (Mistral v0.3/Nemo:
# ``tool_call.id|length != 9`` -> "... alphanumeric strings with length 9!")
_NINE_CHAR_IDS = re.compile(r"\|\s*length\s*[!=]=\s*9\b|alphanumeric strings with length 9")


def _reads(template: str, name: str) -> bool:
    """Whether the template reads the variable ``name`` (not ``enable_thinking``
    for ``thinking``, nor a message's ``.thinking`` field or a quoted word)."""
    return re.search(rf"(?<![\w.'\"]){name}(?![\w'\"])", template) is not None


def _family(tokenizer: Any) -> str | None:
    """mlx-lm's tool parser for the template, by its module's name."""
    parser = getattr(tokenizer, "tool_parser", None)
    return parser.__module__.rsplit(".", 1)[-1] if parser is not None else None


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: their texts, not their names
        template = list(template.values())
    return template if isinstance(template, str) else " ".join(map(str, template or ()))


def demands_short_call_ids(tokenizer: Any) -> bool:
    """Whether the template accepts only 9-alphanumeric tool-call ids: it checks
    their length, or it is Mistral's (the family's markup, whatever it checks)."""
    return (
        _family(tokenizer) == "mistral"
        or _NINE_CHAR_IDS.search(_template_text(tokenizer)) is not None
    )


def probe_syntax(tokenizer: Any) -> TextSyntax:
    """From an mlx-lm TokenizerWrapper. Models without think tokens still get the
    plain-text ``<think>`` tags: small models write them as text when prompted."""
    think_start = getattr(tokenizer, "think_start", None) or "<think>"
    think_end = getattr(tokenizer, "think_end", None) or "</think>"
    family = _family(tokenizer)
    text = _template_text(tokenizer)
    return TextSyntax(
        think_start=think_start,
        think_end=think_end,
        tool_family=family,
        tool_call_start=getattr(tokenizer, "tool_call_start", None) if family else None,
        tool_call_end=getattr(tokenizer, "tool_call_end", None) if family else None,
        template_vars=frozenset(v for v in KNOWN_VARS if _reads(text, v)),
        short_call_ids=demands_short_call_ids(tokenizer),
    )
