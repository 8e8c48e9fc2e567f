"""mlx-lm's tool-call parsers of families whose regexes backtrack on model text,
read here in one pass with the same results.

A reply's calls are decoded on the event loop when it ends. mlx-lm's Kimi K2,
Kimi K3, Muse Spark, MiniMax M2, FunctionGemma and pythonic regexes scan on to
the end of the text from every opening tag that is never closed, so a model
looping on an opening held the loop for a time growing with the square of the
reply's length (or worse). Each reader below
finds what its regex finds, in the order it finds it: where a search fails from
one opening it fails from every later one, or each later search starts where an
answer already found still lies ahead (``_Ahead``).
"""

from __future__ import annotations

import ast
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


# Muse Spark: <atem:invoke name="f"><atem:parameter name="k">v</atem:parameter></atem:invoke>

_INVOKE = regex.compile(r"<atem:invoke\b")
_PARAMETER = regex.compile(r"<atem:parameter\b")
_NAME = regex.compile(r'\bname="')


def muse_spark(text: str) -> list[dict[str, Any]]:
    """mlx-lm's Muse Spark parser."""
    calls = [
        {"name": name, "arguments": {k: _atem_value(v) for k, v in _atem_parameters(body)}}
        for name, body in _atem_invokes(text)
    ]
    if not calls:
        raise ValueError("no Muse Spark tool call")
    return calls


class _FirstName:
    """Where the first ``name="NAME"`` from a position on starts and its quote closes,
    as mlx-lm's Muse Spark regexes read one: a word boundary before it, NAME not
    empty, and ``fits(closing quote)``. For positions that never go back: each
    ``name="`` is looked at once. None: there is none."""

    def __init__(self, text: str, fits: Callable[[int], bool]) -> None:
        self._text, self._fits = text, fits
        self._names, self._quotes = _Ahead(text, 'name="'), _Ahead(text, '"')
        self._found: tuple[int, int] | None = (-1, -1)  # not looked for yet

    def __call__(self, pos: int) -> tuple[int, int] | None:
        if self._found is not None and self._found[0] < pos:
            self._found = self._search(pos)
        return self._found

    def _search(self, pos: int) -> tuple[int, int] | None:
        while (start := self._names(pos)) >= 0:
            quote = self._quotes(start + 6)
            if quote > start + 6 and _NAME.match(self._text, start) and self._fits(quote):
                return start, quote
            pos = start + 1
        return None


def _atem_invokes(text: str) -> Iterator[tuple[str, str]]:
    """(name, body) of each ``<atem:invoke ... name="NAME">BODY`` as mlx-lm's regex
    finds them: NAME the first one before the opening's first ``>`` whose quote is
    followed by ``>``, BODY running a whole parameter at a time to the first
    ``</atem:invoke>`` or the end. Its regex read to the end from every opening
    with no ``>`` after it, or through every parameter never closed (16 KB of
    ``<atem:invoke name``: a quarter second)."""
    names = _FirstName(text, lambda quote: text.startswith('">', quote))
    first_gt, ends = _Ahead(text, ">"), _Ahead(text, "</atem:invoke>")
    parameters, closes = _Ahead(text, "<atem:parameter"), _Ahead(text, "</atem:parameter>")
    limit = len(text) - 1 if text.endswith("\n") else len(text)  # where "$" first matches
    pos = 0
    while (start := text.find("<atem:invoke", pos)) >= 0:
        pos = start + 1
        if _INVOKE.match(text, start) is None:
            continue
        if (name := names(start + 12)) is None:
            return  # no later opening has a name either
        if first_gt(start + 12) < name[0]:
            continue  # a ">" ends this opening before its name
        body = at = name[1] + 2
        while True:  # to the end, stepping over whole parameters
            end = ends(at)
            stop = end if end >= 0 else limit
            opening = parameters(at)
            if not 0 <= opening < stop:
                break
            if _PARAMETER.match(text, opening) is None:
                at = opening + 1  # "<atem:parameters": a character like any other
                continue
            close = closes(opening + 15)
            if close < 0:
                break  # no later parameter is closed either
            at = close + 17
        yield text[name[0] + 6 : name[1]], text[body:stop]
        pos = stop + 14 if stop == end else stop


def _atem_parameters(body: str) -> Iterator[tuple[str, str]]:
    """(name, value) of each ``<atem:parameter ... name="NAME" ...>VALUE</atem:parameter>``
    in an invoke's body as mlx-lm's regex finds them: NAME the first one before the
    opening's first ``>`` that has a ``>`` and then a closing after it. Its regex
    read to the end from every opening with no ``>`` after it, and again from each
    name (8 s for 16 KB of ``<atem:parameter name="a"``)."""
    first_gt, tag_ends = _Ahead(body, ">"), _Ahead(body, ">")
    closes = _Ahead(body, "</atem:parameter>")
    names = _FirstName(
        body, lambda quote: (tag_end := tag_ends(quote + 1)) >= 0 and closes(tag_end + 1) >= 0
    )
    pos = 0
    while (start := body.find("<atem:parameter", pos)) >= 0:
        pos = start + 1
        if _PARAMETER.match(body, start) is None:
            continue
        if (name := names(start + 15)) is None:
            return  # no later opening has a name either
        if first_gt(start + 15) < name[0]:
            continue  # a ">" ends this opening before its name
        tag_end = tag_ends(name[1] + 1)
        close = closes(tag_end + 1)
        yield body[name[0] + 6 : name[1]], body[tag_end + 1 : close]
        pos = close + 17


def _atem_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.strip()


# FunctionGemma: call:NAME{key:<escape>text<escape>,key:value}

_ESCAPE = "<escape>"


def function_gemma(text: str) -> dict[str, Any]:
    """mlx-lm's FunctionGemma parser: the first ``call:NAME{...}`` its regex
    ``call:(\\w+)\\{(.*?)\\}`` finds, and its arguments. Its ``findall`` read to
    the end from every ``call:NAME{`` never closed (64 KB of ``call:a{``: 1 s), and
    its argument loop copied the rest of the arguments at each one. A name is a
    whole run of word characters (``{`` is none), so each ``call:`` is tried once;
    where no ``}`` follows one ``{``, none follows any later one."""
    name, args = _first_call(text, "call:", _WORD, "{", "}")
    return {"name": name, "arguments": _gemma_arguments(args)}


def _gemma_arguments(args: str) -> dict[str, Any]:
    """mlx-lm's loop over ``key:value`` pairs, by position instead of by slicing."""
    arguments: dict[str, Any] = {}
    pos = 0
    while pos < len(args):
        split = args.index(":", pos)  # none: no call, as mlx-lm
        key, pos = args[pos:split], split + 1
        if args.startswith(_ESCAPE, pos):
            pos += len(_ESCAPE)
            split = args.index(_ESCAPE, pos)
            arguments[key] = args[pos:split]
            pos = split + len(_ESCAPE) + 1
            continue
        split = args.find(",", pos)
        if split < 0:
            split = len(args)
        value, pos = args[pos:split], split + 1
        try:
            arguments[key] = json.loads(value)
        except json.JSONDecodeError:
            arguments[key] = value
    return arguments


# LFM2 and others, pythonic: [name(key="value", key=1)], read as Python first

_PY_NAME = regex.compile(r"[\w.]+")
_PY_VALUE = regex.compile(
    r"""=(?:"(?P<quoted>[^"]*)"|'(?P<quoted>[^']*)'|(?P<bare>[^,]+))(?:,\s*|$)""", regex.DOTALL
)


def pythonic(text: str) -> list[dict[str, Any]] | dict[str, Any]:
    """mlx-lm's pythonic parser: the text as a Python list of calls, or else the
    first ``[name(args)]`` its regex ``\\[([\\w.]+)\\((.*?)\\)\\]`` finds, its
    arguments ``key=value`` as its argument regex finds them. That regex read to
    the end from every ``[name(`` never closed (64 KB of ``[a(``: a quarter
    second). A name is a whole run of ``[\\w.]`` (``(`` is none), so each ``[`` is
    tried once; where no ``)]`` follows one, none follows any later one."""
    from app.protocol.tool_formats import _mlx_module  # here: that module imports this one

    try:  # ast.parse of the text between its first "[" and its last "]": linear
        parsed = _mlx_module("pythonic")._parse_pythonic_tool_call(text)
    except (SyntaxError, ValueError):
        parsed = None
    if parsed is not None:
        return parsed
    name, args = _pythonic_call(text)
    arguments = {}
    pos = 0
    while (key := _WORD.search(args, pos)) is not None:
        # a key is a whole run of word characters ("=" is none): each run is tried once
        pos = key.end()
        if (found := _PY_VALUE.match(args, pos)) is None:
            continue
        pos = found.end()
        bare = found.group("bare")
        value = bare.strip() if bare is not None else found.group("quoted")
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # as mlx-lm: kept as text
            pass
        arguments[key.group().strip()] = value
    return {"name": name, "arguments": arguments}


def _pythonic_call(text: str) -> tuple[str, str]:
    """(name, arguments) of the first ``[name(arguments)]``, as mlx-lm's regex finds it."""
    return _first_call(text, "[", _PY_NAME, "(", ")]")


def _first_call(
    text: str, opener: str, name_pattern: regex.Pattern[str], opening: str, closing: str
) -> tuple[str, str]:
    """(name, arguments) of the first ``OPENER NAME OPENING arguments CLOSING``, as
    a lazy regex finds it, in one pass: a name is a whole run (``opening`` is none
    of its characters), so each opener is tried once, and where no ``closing``
    follows one opening, none follows any later one."""
    pos = 0
    while (start := text.find(opener, pos)) >= 0:
        pos = start + 1
        name = name_pattern.match(text, start + len(opener))
        if name is None or not text.startswith(opening, name.end()):
            continue
        end = text.find(closing, name.end() + 1)
        if end < 0:
            break
        return name.group(), text[name.end() + 1 : end]
    raise ValueError("No function provided.")


def _closed(text: str, opening: str, closing: str) -> Iterator[str]:
    """What mlx-lm's ``findall(OPENING(.*?)CLOSING)`` (DOTALL) finds: the text from
    each opening to the first closing after it. The regex read to the end from
    every opening never closed; where one is not closed, no later one is."""
    pos = 0
    while (start := text.find(opening, pos)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            return
        yield text[start + len(opening) : end]
        pos = end + len(closing)


# MiniMax M2: <invoke name="f"><parameter name="k">v</parameter></invoke>


def minimax_m2(text: str, tools: Any) -> list[dict[str, Any]] | dict[str, Any]:
    """mlx-lm's MiniMax M2 parser, its invokes and parameters found in one pass
    (``_closed``): its regexes read to the end from every ``<invoke name=`` and
    ``<parameter name=`` never closed (64 KB of ``<invoke name=``: 0.1 s, growing
    with the square of the length). Values are converted by its own functions."""
    from app.protocol.tool_formats import _mlx_module  # here: that module imports this one

    module = _mlx_module("minimax_m2")
    invokes = list(_closed(text, "<invoke name=", "</invoke>"))
    if not invokes:
        raise ValueError("No tool call found")
    param_config_for = {}
    for tool in tools or ():
        if (func := tool.get("function", False)) and (params := func.get("parameters", False)):
            param_config_for[func["name"]] = params.get("properties", {})
    calls = []
    for invoke in invokes:
        head = invoke.find(">")  # its name: "^([^>]+)", at least one character
        if head == 0 or not invoke:
            continue
        name = module._extract_name(invoke if head < 0 else invoke[:head])
        config = param_config_for.get(name, {})
        arguments = {}
        for parameter in _closed(invoke, "<parameter name=", "</parameter>"):
            head = parameter.find(">")  # "^([^>]+)>(.*)"
            if head <= 0:
                continue
            key = module._extract_name(parameter[:head])
            value = parameter[head + 1 :].strip()
            value = value.removeprefix("\n").removesuffix("\n")
            types = module._get_param_types_from_config(key, config)
            arguments[key] = module._convert_param_value_with_types(value, types)
        calls.append({"name": name, "arguments": arguments})
    return calls[0] if len(calls) == 1 else calls


# Kimi K2: <|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|>


def kimi_k2(text: str) -> list[dict[str, Any]]:
    """mlx-lm's Kimi K2 parser, its calls found in one pass (``_closed``): its
    regex read to the end from every ``<|tool_call_begin|>`` never closed. Each
    call, or the whole text where none is closed, is read by its own function,
    whose regexes are anchored at the start."""
    from app.protocol.tool_formats import _mlx_module  # here: that module imports this one

    read = _mlx_module("kimi_k2")._parse_single_tool
    calls = list(_closed(text, "<|tool_call_begin|>", "<|tool_call_end|>"))
    return [read(call) for call in calls] if calls else [read(text)]


# the families read here, by mlx-lm's name for their parser
READERS: dict[str, Callable[[str], list[dict[str, Any]] | dict[str, Any]]] = {
    "function_gemma": function_gemma,
    "kimi_k2": kimi_k2,
    "kimi_k3": kimi_k3,
    "muse_spark": muse_spark,
    "pythonic": pythonic,
}
# those whose parser is given the request's tools too
TOOL_READERS: dict[str, Callable[[str, Any], list[dict[str, Any]] | dict[str, Any]]] = {
    "minimax_m2": minimax_m2,
}
