"""mlx-lm's tool-call parsers of families whose regexes backtrack on model text,
read here in one pass with the same results.

A reply's calls are decoded on the event loop when it ends. mlx-lm's Kimi K3
and Muse Spark regexes scan on to the end of the text from every opening tag
that is never closed, so a model looping on an opening held the loop for a time
growing with the square of the reply's length (or worse). Each reader below
finds what its regex finds, in the order it finds it: where a search fails from
one opening it fails from every later one, or each later search starts where an
answer already found still lies ahead (``_Ahead``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import regex  # mlx-lm's parsers' regex engine: its \w and \b, not re's


class _Ahead:
    """``text.find(needle, pos)`` for positions that never go back: an answer still
    ahead of ``pos`` is the answer, so the text is searched once in all."""

    def __init__(self, text: str, needle: str) -> None:
        self._text, self._needle = text, needle
        self._found: int | None = None

    def __call__(self, pos: int) -> int:
        if self._found is None or 0 <= self._found < pos:
            self._found = self._text.find(self._needle, pos)
        return self._found


# Kimi K3: <|open|>call tool="f"<|sep|> <|open|>argument key="k" type="string"<|sep|>v
# <|close|>argument<|sep|> <|close|>call<|sep|> (or one <|open|>json<|sep|>{...} block)

_WORD = regex.compile(r"\w+")


def kimi_k3(text: str) -> list[dict[str, Any]]:
    """mlx-lm's Kimi K3 parser: a call it cannot read is skipped, none is no call."""
    calls = []
    for attributes, body in _xtml_blocks(text, "call"):
        try:
            calls.append(_kimi_k3_call(attributes, body))
        except ValueError:  # JSONDecodeError is one
            continue
    if not calls:
        raise ValueError("no Kimi K3 tool call")
    return calls


def _kimi_k3_call(attributes: str, body: str) -> dict[str, Any]:
    name = _xtml_attributes(attributes).get("tool")
    if not name:
        raise ValueError("a call with no tool name")
    block = next(_xtml_blocks(body, "json"), None)
    if block is not None:
        arguments = json.loads(block[1])
        if not isinstance(arguments, dict):
            raise ValueError("JSON arguments that are no object")
        return {"name": name, "arguments": arguments}
    arguments = {}
    for argument, value in _xtml_blocks(body, "argument"):
        found = _xtml_attributes(argument)
        if "key" not in found:
            raise ValueError("an argument with no key")
        arguments[found["key"]] = _xtml_value(value, found.get("type", "string"))
    return {"name": name, "arguments": arguments}


def _xtml_blocks(text: str, tag: str) -> Iterator[tuple[str, str]]:
    """(attributes, value) of each ``<|open|>TAG ATTRIBUTES<|sep|>VALUE<|close|>TAG<|sep|>``,
    as mlx-lm's regexes find them: attributes run to the first ``<|sep|>``, a value to
    the first closing after it. Their regexes read to the end from every opening
    when none was closed (64 KB of ``<|open|>call``: 9 s); an opening
    left open here means every later one is too."""
    opening, closing = f"<|open|>{tag}", f"<|close|>{tag}<|sep|>"
    pos = 0
    while (start := text.find(opening, pos)) >= 0:
        sep = text.find("<|sep|>", start + len(opening))
        end = text.find(closing, sep + len("<|sep|>")) if sep >= 0 else -1
        if end < 0:
            return
        yield text[start + len(opening) : sep], text[sep + len("<|sep|>") : end]
        pos = end + len(closing)


def _xtml_attributes(text: str) -> dict[str, str]:
    """``key="value"`` pairs as mlx-lm's ``(\\w+)="([^"]*)"`` finds them: a key ends
    where its run of word characters does, so each run is tried once."""
    found: dict[str, str] = {}
    pos = 0
    while (key := _WORD.search(text, pos)) is not None:
        pos = key.end()
        if text.startswith('="', pos):
            close = text.find('"', pos + 2)
            if close < 0:
                break  # no later value is closed either
            found[key.group()] = text[pos + 2 : close].replace("&quot;", '"').replace("&amp;", "&")
            pos = close + 1
    return found


def _xtml_value(value: str, value_type: str) -> Any:
    if value_type == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:  # as mlx-lm: any other error skips the call
        return value


# the families read here, by mlx-lm's name for their parser
READERS: dict[str, Callable[[str], list[dict[str, Any]]]] = {"kimi_k3": kimi_k3}
