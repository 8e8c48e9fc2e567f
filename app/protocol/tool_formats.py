"""Tool-call markup models really emit, and decoding it into calls.

Every format is recognised whatever the model family; the family only decides
which parser is tried first where one markup carries several inner formats
(``<tool_call>`` holds Qwen XML, GLM key/value pairs or Hermes JSON). The inner
parsers are mlx-lm's (``mlx_lm.tool_parsers``), imported on first use so the
HTTP layer does not import mlx before the engine has chosen its BLAS. Where one
of their regexes backtracks on model text (a reply is decoded on the event loop,
and every markup is recognised for every family), what reaches it is screened in
one pass or the markup is read here instead, with the same results on
well-formed markup. Decoding never raises: markup that does not parse is
returned to the caller as None and goes out as plain content.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import regex  # mlx-lm's parsers' regex engine: its \w, \s and \b, not re's

from app.protocol.family_parsers import READERS, TOOL_READERS
from app.protocol.tool_schema import (
    coerce_arguments,
    parameter_schemas,
    parameter_types,
    wants_text,
)

log = logging.getLogger("kvwarm.tools")


@dataclass(frozen=True)
class Markup:
    """Where a call starts and ends in the text; ``end`` "" = at the end of the output.
    ``orphan``: the closing of an opening the model left out, which ``start``
    stands in for: dropped right after the call; such a call needs its ``end``."""

    kind: str
    start: str
    end: str
    orphan: str = ""


TOOL_CALL_TAG = Markup("tool_call", "<tool_call>", "</tool_call>")  # Qwen, GLM, Hermes
MINICPM = Markup("minicpm", "<function name=", "</function>")
MISTRAL = Markup("mistral", "[TOOL_CALLS]", "")
GEMMA4 = Markup("gemma4", "<|tool_call>", "<tool_call|>")
PYTHON_TAG = Markup("llama3_json", "<|python_tag|>", "")  # Llama 3.x
BARE_JSON = Markup("llama3_json", "", "")  # Llama 3.x JSON with no tag, at the start of a reply

MARKED = (TOOL_CALL_TAG, MINICPM, MISTRAL, GEMMA4, PYTHON_TAG)
# Qwen3-Coder and Qwen3.5+ (mlx-lm's qwen3_coder family) often leave out the opening
# <tool_call> and write "<function=f>...</function>\n</tool_call>" (vLLM's parser keys
# on <function=): for that family a call when it names one of the request's tools
QWEN_FUNCTION = Markup("qwen_function", "<function=", "</function>", "</tool_call>")
# families whose markup is one of MARKED; any other family mlx-lm detects (Kimi,
# MiniMax, LFM2 pythonic, ...) brings its own markup and parser
BUILT_IN_FAMILIES = frozenset(
    {"qwen3_coder", "glm47", "json_tools", "minicpm5", "mistral", "gemma4"}
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    call_id: str | None = None  # when the model wrote one (Mistral)

    def arguments_dict(self) -> dict[str, Any]:
        return json.loads(self.arguments)


@cache
def _mlx_parser(name: str):
    return _mlx_module(name).parse_tool_call


def _mlx_module(name: str):
    """mlx-lm's parser module ``name`` (see ``_parsers_package``)."""
    return importlib.import_module(f"{_parsers_package()}.{name}")


PARSERS_PACKAGE = "kvwarm_mlx_lm_tool_parsers"


@cache
def _parsers_package() -> str:
    """mlx-lm's ``tool_parsers`` as a package of its own. Its modules are plain
    Python, but imported as ``mlx_lm.tool_parsers`` they run ``mlx_lm/__init__``,
    which imports MLX and makes MLX streams on the thread that parses: the HTTP
    event loop's, whose MLX thread-locals then ran their destructors during
    interpreter shutdown and aborted the process."""
    found = importlib.util.find_spec("mlx_lm")  # located, not imported
    if found is None or found.origin is None:
        raise ImportError("mlx_lm is not installed")
    folder = Path(found.origin).parent / "tool_parsers"
    spec = importlib.util.spec_from_file_location(
        PARSERS_PACKAGE, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[PARSERS_PACKAGE] = package
    spec.loader.exec_module(package)
    return PARSERS_PACKAGE


def _tool_call_tag_parsers(inner: str, family: str | None) -> list[str]:
    found = []
    if "<function=" in inner:
        found.append("qwen3_coder")
    if "<arg_key>" in inner:
        found.append("glm47")
    if inner.lstrip()[:1] in ("{", "["):
        found.append("json_tools")
    if family == "glm47" and "glm47" not in found:
        found.append("glm47")  # GLM also writes bare names: <tool_call>get_time</tool_call>
    return sorted(found, key=lambda name: name != family)


# parsers of XML-style parameters (<parameter=NAME> / <param name="NAME">)
XML_PARAMETERS = frozenset({"qwen3_coder", "minicpm5"})
# parsers whose markup types its own values (JSON, Python literals); every other
# markup writes values as text, and an untyped one holding JSON is decoded
TYPED_VALUES = frozenset(
    {
        "json_tools",
        "llama3_json",
        "mistral",
        "gemma4",
        "kimi_k2",
        "kimi_k3",
        "pythonic",
        "muse_spark",
    }
)
# where one Qwen function ends and the next begins inside one <tool_call> block
_FUNCTION_SEAM = re.compile(r"</function>\s*(?=<function=)")
# a Qwen parameter's opening exactly as written: "<parameter=NAME>"
_QWEN_OPENING = re.compile(r"<parameter=([^<>]*)>")
_XML_PARAMETER = re.compile(
    r"<parameter=\s*([^\s<>]+)>?|<param\s+name\s*=\s*(\"[^\"]*\"|'[^']*'|[^\s\"'<>]+)\s*>"
)


def _null_texts(inner: str) -> dict[str, list[str]]:
    """Per parameter name, in order, the values written as some casing of "null",
    as mlx-lm's parsers trim them (Qwen: one newline each side; MiniCPM: spaces or a
    CDATA section). One pass: each closing tag is searched for from its opening on."""
    out: dict[str, list[str]] = {}
    pos = 0
    while (found := _XML_PARAMETER.search(inner, pos)) is not None:
        qwen = found.group(1) is not None
        close = "</parameter>" if qwen else "</param>"
        end = inner.find(close, found.end())
        if end < 0:
            break  # no later parameter is closed either
        text = inner[found.end() : end]
        if qwen:
            text = text.removeprefix("\n").removesuffix("\n")
        else:
            text = text.strip()
            if text.startswith("<![CDATA[") and text.endswith("]]>"):
                text = text[9:-3]
        if text.lower() == "null":
            name = found.group(1) if qwen else found.group(2).strip("\"'")
            out.setdefault(name, []).append(text)
        pos = end + len(close)
    return out


def _qwen3_coder(inner: str) -> list[dict[str, Any]]:
    """Every ``<function=...>`` of one ``<tool_call>`` block: Qwen3-Coder sometimes
    writes several in one, and mlx-lm's parser reads a block as one function (from
    the first opening to the last closing: the first name, all the parameters)."""
    parse = _mlx_parser("qwen3_coder")
    pieces = _functions(inner)
    for piece in pieces:
        _all_closed(piece, "<parameter=", "</parameter>")
    return [parse(_function_span(piece)) for piece in pieces]


def _function_span(piece: str) -> str:
    """The ``<function=...</function>`` that mlx-lm's regex, ``<function=(.*?)
    </function>$``, finds in ``piece``, cut here: searched for, it was tried again
    from each ``<function=`` when the piece did not end in a closing (a value
    quoting Qwen markup, then text after the call: 416 KB held the event loop
    2.5 s). Handed the span, it matches from its first character in one pass.
    ``$`` is the end, or the place before a last newline."""
    start = piece.find("<function=")
    close = len(piece) - piece.endswith("\n") - len("</function>")
    if start < 0 or close < start or not piece.startswith("</function>", close):
        raise ValueError("No function provided.")  # as mlx-lm's parser
    return piece[start : close + len("</function>")]


_QWEN_NAME = re.compile(r"[^\s<>]+\s*>")


def _bare_qwen_function(inner: str) -> list[dict[str, Any]]:
    """A function written without its ``<tool_call>`` (``inner``: what follows
    ``<function=``, up to its ``</function>``): its name, then only parameters,
    else it is prose quoting the markup. One pass."""
    name = _QWEN_NAME.match(inner)
    if name is None:
        raise ValueError("no function name")
    pos = name.end()
    while (pos := _spaces_end(inner, pos)) < len(inner):
        if not inner.startswith("<parameter=", pos):
            raise ValueError("text that is no parameter")
        close = inner.find("</parameter>", pos)
        if close < 0:
            raise ValueError("an argument is never closed")
        pos = close + len("</parameter>")
    return _qwen3_coder(f"<function={inner}</function>")


def _all_closed(piece: str, opening: str, closing: str) -> None:
    """Raise if an argument's ``opening`` is never closed: mlx-lm's XML parsers
    then drop it, and the call would run with an argument missing. One pass."""
    pos = 0
    while (opened := piece.find(opening, pos)) >= 0:
        closed = piece.find(closing, opened)
        if closed < 0:
            raise ValueError("an argument is never closed")
        pos = closed + len(closing)


# mlx-lm's MiniCPM function header (its ``_function_regex`` up to the body), anchored
_MINICPM_HEAD = regex.compile(
    r"\s*(?:<function\s+)?(?:name\s*=\s*)?(?:\"[^\"]*\"|'[^']*'|[^\s\"'<>]+)\s*>"
)


def _minicpm(text: str) -> list[Any]:
    """mlx-lm's MiniCPM parser on each function alone (``_minicpm_functions``)."""
    _all_closed(text, "<param", "</param>")
    parse = _mlx_parser("minicpm5")
    return [parse(piece, None) for piece in _minicpm_functions(text.rstrip())]


def _minicpm_functions(text: str) -> list[str]:
    """``text`` cut after each ``</function>``, each piece starting with a header.
    mlx-lm's regex searches for a header, and its name pattern ``[^\\s"'<>]+\\s*>``
    backtracked through a whole word from each of its characters when a ``>`` came
    later (prose: ``<function name=``, a 16 KB base64 string, then ``->``: 6 s on
    the event loop, for a model of any family). A header where a function starts
    is the one that search finds, and the piece's body ends where the regex's does;
    text that starts with none is no call. One pass."""
    pieces, pos = [], 0
    while True:  # text is stripped: any of it left holds more than spaces
        head = _MINICPM_HEAD.match(text, pos)
        if head is None:
            raise ValueError("no function header where a function starts")
        end = text.find("</function>", head.end())
        start, pos = pos, len(text) if end < 0 else end + len("</function>")
        pieces.append(text[start:pos])
        if pos == len(text):
            return pieces


# a run of what mlx-lm's Mistral header regex, ``([\w-]+)\s*\[ARGS\]\s*``, reads as a
# name, and its spaces (the ``regex`` module's \s, as mlx-lm's). No pattern holds
# "[ARGS]": an anchored ``regex`` match looks ahead for a literal it requires,
# through the rest of the text, so one tried after each word was quadratic on prose.
_NAME_RUN = regex.compile(r"[\w-]+")
_SPACES = regex.compile(r"\s*")


@dataclass(frozen=True)
class _Rest:
    """What a parser read (``calls``), and the text the model wrote after it."""

    calls: Any
    rest: str


def _mistral(text: str) -> list[dict[str, Any]] | dict[str, Any]:
    """mlx-lm's Mistral parser (see ``_mistral_read``): the calls alone."""
    return _mistral_read(text).calls


def _mistral_read(text: str) -> _Rest:
    """mlx-lm's Mistral parser, its ``name[ARGS]{...}`` form read in one pass: its
    header regex, searched for, backtracked through a whole run of word characters
    from each of them when ``[ARGS]`` came later (prose holding a 16 KB hex string,
    then ``f[ARGS]``: 6 s on the event loop, for a model of any family). Its
    markup runs to the end of the reply: what follows the last call's arguments
    ("I have called f; ...") is the rest, which mlx-lm dropped."""
    try:
        listed = isinstance(json.loads(text), list)
    except json.JSONDecodeError:  # as mlx-lm: any other error is no call
        listed = False
    if listed:  # its JSON form: one json.loads, no header regex (an empty list has no run)
        return _Rest(_mlx_parser("mistral")(text), "")
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while (header := _mistral_header(text, pos)) is not None:
        name, pos = header
        arguments, pos = decoder.raw_decode(text, pos)  # cut short: not a call, as mlx-lm
        calls.append({"name": name, "arguments": arguments})
    if not calls:
        raise ValueError("no Mistral tool call")
    return _Rest(calls, text[pos:])


def _mistral_header(text: str, pos: int) -> tuple[str, int] | None:
    """The first ``name[ARGS]`` from ``pos`` on, as the header regex's search finds it:
    a name ends where its run of word characters does, so each run is tried once.
    (The name, where its arguments start.)"""
    if text.find("[ARGS]", pos) < 0:
        return None  # prose, the usual case: one scan, not one step per word
    while (run := _NAME_RUN.search(text, pos)) is not None:
        tag = _spaces_end(text, run.end())
        if text.startswith("[ARGS]", tag):
            return run.group(), _spaces_end(text, tag + len("[ARGS]"))
        pos = run.end()
    return None


def _spaces_end(text: str, pos: int) -> int:
    """Where the spaces from ``pos`` on end (``pos`` itself where there are none)."""
    spaces = _SPACES.match(text, pos)
    assert spaces is not None  # it matches the empty string
    return spaces.end()


def _functions(inner: str) -> list[str]:
    """``inner`` cut between functions, never inside a parameter's value (a file
    holding Qwen markup is one argument). One pass: every search starts where the
    last one ended."""
    pieces, start = [], 0
    seam = _FUNCTION_SEAM.search(inner)
    param = inner.find("<parameter=")
    while seam is not None:
        if 0 <= param < seam.start():  # a value first: the seam may lie inside it
            close = inner.find("</parameter>", param)
            if close < 0:
                break  # an unclosed value runs to the end: nothing after it is a seam
            past = close + len("</parameter>")
            param = inner.find("<parameter=", past)
            if seam.start() < past:
                seam = _FUNCTION_SEAM.search(inner, past)
            continue
        pieces.append(inner[start : seam.start()] + "</function>")
        start = seam.end()
        seam = _FUNCTION_SEAM.search(inner, start)
    pieces.append(inner[start:])
    return pieces


_GEMMA4_TOKENS = re.compile(r'<\|"\|>|call:[\w-]+\{|[{}]')


def _gemma4_spans(inner: str) -> list[tuple[int, int]]:
    """Where each ``call:NAME{...}`` is, braces balanced and ``<|"|>`` strings
    skipped, found in one pass: mlx-lm's Gemma 4 regex matches nested braces
    recursively from every ``call:`` and, given calls never closed, reads to the
    end from each (28 KB of ``call:f{`` held the event loop 7 s, whatever the
    model: every markup is recognised for every family). The outermost calls,
    in order; on well-formed markup what the regex finds."""
    spans: list[tuple[int, int]] = []
    opened: list[int | None] = []  # per open brace: where its call starts, if it opens one
    in_string = False
    for token in _GEMMA4_TOKENS.finditer(inner):
        text = token.group()
        if text == '<|"|>':
            in_string = not in_string
        elif in_string:
            continue
        elif text == "}":
            start = opened.pop() if opened else None
            if start is not None:
                spans.append((start, token.end()))
        else:
            opened.append(token.start() if text != "{" else None)
    # a call closes before the one around it: the outer one, found later, wins
    return _outermost(spans)


def _outermost(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    kept: list[tuple[int, int]] = []
    for span in sorted(spans):
        if not kept or span[0] >= kept[-1][1]:
            kept.append(span)
    return kept


def _gemma4(inner: str) -> list[Any]:
    """Each call (see ``_gemma4_spans``) as mlx-lm's Gemma 4 parser reads it."""
    spans = _gemma4_spans(inner)
    if not spans:
        raise ValueError("no balanced call")
    return [_gemma4_call(inner, a, b) for a, b in spans]


_GEMMA4_QUOTE = '<|"|>'
# mlx-lm's bare key (``_gemma4_args_to_json``), its ``regex`` \w
_GEMMA4_KEY = regex.compile(r"(?<=[{,])(\w+):")


def _gemma4_call(inner: str, start: int, end: int) -> dict[str, Any]:
    """The call ``inner[start:end]`` (``call:NAME{...}``), its arguments turned
    into JSON as mlx-lm's ``_gemma4_args_to_json`` does, strings read in one pass:
    it put each string back with a ``replace`` over the whole argument text
    (16,000 strings in 533 KB: 3.9 s on the event loop). Keys are quoted between
    strings only (the character before a segment is a string's end, which the key
    pattern's look-behind never takes); within a call strings pair up."""
    brace = inner.find("{", start, end)
    parts, pos, quote = [], brace, len(_GEMMA4_QUOTE)
    while (opened := inner.find(_GEMMA4_QUOTE, pos, end)) >= 0:
        closed = inner.find(_GEMMA4_QUOTE, opened + quote, end)
        if closed < 0:
            raise ValueError("a string is never closed")
        parts.append(_GEMMA4_KEY.sub(r'"\1":', inner[pos:opened]))
        parts.append(json.dumps(inner[opened + quote : closed]))
        pos = closed + quote
    parts.append(_GEMMA4_KEY.sub(r'"\1":', inner[pos:end]))
    return {"name": inner[start + len("call:") : brace], "arguments": json.loads("".join(parts))}


# what mlx-lm's GLM and LongCat pair regexes allow between a key and its value
_PAIR_GAP = regex.compile(r"(?:\\n|\s)*")


def _glm_pairs(inner: str, key_tag: str = "arg_key", value_tag: str = "arg_value") -> str:
    """GLM markup rebuilt from its well-formed ``<arg_key>K</arg_key> <arg_value>V
    </arg_value>`` pairs, found in one pass: mlx-lm's pair regex, given pairs left
    open (a model looping on them), backtracks over the whole tail for each one,
    cubic in the reply's length (32 KB: 4 s on the event loop; 64 KB: minutes).
    On well-formed markup it reads what the regex reads; a pair left open, or a
    key with no value after it, makes it no call (its argument would be missing).
    LongCat writes the same pairs with its own tags (``longcat_arg_key``)."""
    key_open, key_close = f"<{key_tag}>", f"</{key_tag}>"
    value_open, value_close = f"<{value_tag}>", f"</{value_tag}>"
    first = inner.find(key_open)
    if first < 0:
        return inner  # a bare name, JSON, or key=value text: no pair regex runs
    pairs, pos = [inner[:first]], first
    while (key := inner.find(key_open, pos)) >= 0:
        key_end = inner.find(key_close, key + len(key_open))
        if key_end < 0:
            raise ValueError("an argument's name is never closed")
        gap = _PAIR_GAP.match(inner, key_end + len(key_close))
        assert gap is not None  # it matches the empty string
        value = gap.end()
        if not inner.startswith(value_open, value):
            raise ValueError("an argument has no value")
        value_end = inner.find(value_close, value + len(value_open))
        if value_end < 0:
            raise ValueError("an argument's value is never closed")
        pairs.append(inner[key : value + len(value_open)])
        pairs.append(inner[value + len(value_open) : value_end] + value_close)
        pos = value_end + len(value_close)
    return "".join(pairs)


def _plausible(parser: str, call: dict[str, Any], schemas: Mapping[str, Any]) -> bool:
    """Whether a decoded call is one: a name is never text with spaces or markup
    in it, and GLM's parser, which turns any text into a call (``raw`` holding
    what it could not read), did not fall back to that."""
    name = call["name"]
    if any(c.isspace() or c in "<>" for c in name):
        return False
    args = call["arguments"]
    if parser == "qwen3_coder" and _swallowed(args, schemas.get(name, {})):
        return False
    return not (parser == "glm47" and "raw" in args and "raw" not in schemas.get(name, {}))


def _swallowed(args: Mapping[str, Any], schema: Mapping[str, Any]) -> bool:
    """A value holding another of the function's own parameters, not given on its
    own: the model left a ``</parameter>`` out, and the next parameter ran into this
    one (the call would write a file named "a.py\\n<parameter=content>..." and lose
    its content). A file holding Qwen markup keeps its parameters given. One scan
    of each value for parameter openings, whatever the schema's size."""
    missing = schema.keys() - args.keys()
    return bool(missing) and any(
        found.group(1) in missing
        for value in args.values()
        if isinstance(value, str)
        for found in _QWEN_OPENING.finditer(value)
    )


def _json_run(inner: str, separators: str) -> Iterator[Any]:
    """Successive JSON values, whitespace or ``separators`` between them (one pass)."""
    decoder = json.JSONDecoder()
    pos, skip = 0, " \t\r\n" + separators
    while True:
        while pos < len(inner) and inner[pos] in skip:
            pos += 1
        if pos == len(inner):
            return
        value, pos = decoder.raw_decode(inner, pos)
        yield value


def _llama3_json(inner: str) -> list[dict[str, Any]]:
    """One or more ``{"name": ..., "parameters": {...}}`` objects, ``;``-separated."""
    calls = []
    for obj in _json_run(inner, ";"):
        if not isinstance(obj, dict) or "name" not in obj:
            raise ValueError("not a tool call")
        args = obj.get("parameters", obj.get("arguments", {}))
        calls.append({"name": obj["name"], "arguments": args})
    return calls


def _json_values(inner: str) -> list[Any]:
    """The JSON values of one ``<tool_call>`` block, lists flattened: Qwen2.5-style
    models now and then write two call objects in one block, which a single
    ``json.loads`` (mlx-lm's parser) refused, sending both calls out as text."""
    values: list[Any] = []
    for value in _json_run(inner, ","):
        values.extend(value if isinstance(value, list) else [value])
    return values


def _as_calls(parsed: Any) -> list[dict[str, Any]]:
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, Mapping):
            raise ValueError("not a tool call")
        # Llama-style "parameters" inside a <tool_call> tag is the same call's arguments
        name = item.get("name")
        args = item["arguments"] if "arguments" in item else item.get("parameters", {})
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        if not isinstance(name, str) or not name.strip() or not isinstance(args, Mapping):
            raise ValueError("not a tool call")
        calls.append({"name": name.strip(), "arguments": dict(args), "id": item.get("id")})
    if not calls:
        raise ValueError("no tool call")
    return calls


def _allows_text(types: frozenset[str]) -> bool:
    """A parameter a string may be given for: one of its types, or none known."""
    return "string" in types or not types - {"null"}


def _text_tools(
    schemas: Mapping[str, Mapping[str, Any]], types: Mapping[str, Mapping[str, frozenset[str]]]
) -> list[dict[str, Any]]:
    """The tools as mlx-lm's GLM and LongCat parsers are to read them: those keep a
    value as text only where its schema says exactly ``"type": "string"``, and read
    every other one as JSON or a Python literal, so an Optional[str] (pydantic's,
    FastMCP's ``anyOf``), a ``["string", "null"]``, a ``$ref`` or an untyped
    parameter written "1.10", "true" or "3" became 1.1, True or 3 (no schema
    check after them can tell it was text). Each such parameter reads here as
    ``{"type": "string"}``; the others keep their schemas."""
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {
                    "type": "object",
                    "properties": {
                        key: {"type": "string"} if _allows_text(types[name][key]) else schema
                        for key, schema in props.items()
                    },
                },
            },
        }
        for name, props in schemas.items()
    ]


class ToolCallDecoder:
    """Decodes withheld markup into calls, against one request's tools."""

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]],
        family: str | None = None,
        family_markup: tuple[str, str] | None = None,
        allowed: frozenset[str] | None = None,
    ):
        self.tools = list(tools)
        self.family = family
        self.allowed = allowed  # a call naming another function stays text
        self._schemas = parameter_schemas(self.tools)
        self._types = parameter_types(self._schemas)  # here, in the request's preparation
        self._text_tools = _text_tools(self._schemas, self._types)
        # the tools a function written without its <tool_call> may call (QWEN_FUNCTION)
        self.bare_names = frozenset(n for n in self._schemas if allowed is None or n in allowed)
        self.markups: tuple[Markup, ...] = MARKED
        if family == "qwen3_coder" and self.bare_names:
            self.markups = (*MARKED, QWEN_FUNCTION)
        if family and family not in BUILT_IN_FAMILIES and family_markup and family_markup[0]:
            own = Markup(family, family_markup[0], family_markup[1] or "")
            self.markups = (own, *(m for m in MARKED if m.start != own.start))

    @property
    def bare_json(self) -> bool:
        """Llama 3 writes calls as bare JSON; its templates name no family. A model
        of a known family answering in JSON is not calling a tool."""
        return self.family is None

    def decode(self, markup: Markup, inner: str) -> list[ToolCall] | None:
        decoded = self.decode_reply(markup, inner)
        return None if decoded is None else decoded[0]

    def decode_reply(self, markup: Markup, inner: str) -> tuple[list[ToolCall], str] | None:
        """The calls in ``inner``, and the text after them that is no part of
        their markup (Mistral's, which runs to the end of the reply)."""
        for name, parser in self._parsers(markup, inner):
            try:
                parsed, rest = parser(inner), ""
                if isinstance(parsed, _Rest):
                    parsed, rest = parsed.calls, parsed.rest
                calls = _as_calls(parsed)
                if markup in (BARE_JSON, QWEN_FUNCTION) and any(
                    c["name"] not in self._schemas for c in calls
                ):
                    continue  # a JSON answer, or prose quoting markup, that looks like a call
                if not all(_plausible(name, c, self._schemas) for c in calls):
                    continue  # another parser may read it; else it stays text
                if self.allowed is not None and any(c["name"] not in self.allowed for c in calls):
                    continue  # a function this turn does not allow: not a call
                nulls = _null_texts(inner) if name in XML_PARAMETERS else {}
                return [self._finish(c, nulls, name not in TYPED_VALUES) for c in calls], rest
            except Exception as exc:  # noqa: BLE001 - any model text must be survivable
                log.debug("%s markup did not parse: %s", markup.kind, exc)
        return None

    def _parsers(self, markup: Markup, inner: str) -> list[tuple[str, Any]]:
        """(parser name, parse) in the order to try them."""
        if markup.kind == "llama3_json":
            return [("llama3_json", _llama3_json)]
        if markup is TOOL_CALL_TAG:
            names = _tool_call_tag_parsers(inner, self.family)
            # GLM's parser keeps declared string arguments as strings only when given the tools
            return [
                (
                    n,
                    _qwen3_coder
                    if n == "qwen3_coder"
                    else _json_values
                    if n == "json_tools"
                    else (lambda text: self._text_valued("glm47", _glm_pairs(text)))
                    if n == "glm47"
                    else _mlx_parser(n),
                )
                for n in names
            ]
        if markup is QWEN_FUNCTION:
            return [("qwen3_coder", _bare_qwen_function)]
        if markup is MINICPM:
            return [("minicpm5", _minicpm)]
        if markup is GEMMA4:
            return [("gemma4", _gemma4)]
        if markup is MISTRAL:
            return [("mistral", _mistral_read)]
        # the family's own markup, and mlx-lm's parser for it unless read here
        if (reader := READERS.get(markup.kind)) is not None:
            return [(markup.kind, reader)]
        if (read := TOOL_READERS.get(markup.kind)) is not None:
            return [(markup.kind, lambda text: read(text, self.tools))]
        if markup.kind == "longcat":  # GLM's pairs under other tags, open ones dropped
            pairs = lambda text: _glm_pairs(text, "longcat_arg_key", "longcat_arg_value")  # noqa: E731
            return [("longcat", lambda text: self._text_valued("longcat", pairs(text)))]
        return [(markup.kind, lambda text: _mlx_parser(markup.kind)(text, self.tools))]

    def _text_valued(self, parser: str, text: str) -> Any:
        """mlx-lm's GLM or LongCat parser on ``text``, values written as text kept as
        text wherever the schema allows a string (``_text_tools``): ``_finish`` types
        them against the whole schema, as it types Qwen's. JSON the model wrote
        (their fallbacks) is read against the tools as given: it typed its values."""
        if parser == "glm47":  # its pairs, else JSON, else "name key=value" text
            as_text = "<arg_key>" in text or "{" not in text
        else:  # LongCat: JSON when it starts as JSON (tools unread), else its pairs
            as_text = not text.lstrip().startswith("{")
        call = _mlx_parser(parser)(text, self._text_tools if as_text else self.tools)
        name = call.get("name") if isinstance(call, dict) else None
        args = call.get("arguments") if isinstance(call, dict) else None
        if not as_text or not isinstance(name, str) or not isinstance(args, dict):
            return call
        schemas, types = self._schemas.get(name, {}), self._types.get(name, {})
        for key, value in args.items():
            # any casing of null is null, unless the value must be a string (as Qwen's)
            if isinstance(value, str) and value.lower() == "null" and key in types:
                if not wants_text(schemas.get(key), types[key]):
                    args[key] = None
        return call

    def _finish(
        self, call: dict[str, Any], nulls: dict[str, list[str]], from_text: bool
    ) -> ToolCall:
        schemas = self._schemas.get(call["name"], {})
        types = self._types.get(call["name"], {})
        arguments = dict(call["arguments"])
        for key, value in call["arguments"].items():
            # mlx-lm's XML parsers read any casing of "null" as null before looking at a
            # schema: a string argument whose text is "null" is that text
            texts = nulls.get(key)
            if value is None and texts:
                text = texts.pop(0)  # parameters in order: the n-th null of this name
                if wants_text(schemas.get(key), types.get(key)):
                    arguments[key] = text
        args = coerce_arguments(arguments, schemas, from_text, types)
        call_id = _whole_chars(call["id"]) if isinstance(call.get("id"), str) else None
        # NaN or Infinity is no JSON a client could parse: not a call, its text stays
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
        return ToolCall(_whole_chars(call["name"]), _whole_chars(arguments), call_id)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _whole_chars(text: str) -> str:
    """``text`` with lone surrogates (a model's ``"\\ud83d"`` escape, decoded by the
    JSON parser) as U+FFFD: UTF-8 cannot hold them, and the reply's encoding
    failed after the whole generation (a 500, or a stream cut without an error)."""
    return _LONE_SURROGATE.sub("\ufffd", text) if _LONE_SURROGATE.search(text) else text


@dataclass(frozen=True)
class ForcedOpening:
    """Text appended after the generation prompt so the model's turn starts inside
    a call: how ``tool_choice`` required/named is kept without a grammar engine."""

    text: str
    markup: Markup
    seed: str  # ``text`` after ``markup.start``: the start of the withheld call


def forced_opening(family: str | None, name: str | None) -> ForcedOpening:
    """The opening of a call in the family's own markup (Hermes JSON when unknown),
    naming the function when one is forced."""
    if family == "qwen3_coder":
        markup, seed = TOOL_CALL_TAG, "\n<function=" + (f"{name}>\n" if name else "")
    elif family == "glm47":
        markup, seed = TOOL_CALL_TAG, f"{name}\n" if name else ""
    elif family == "mistral":
        markup, seed = MISTRAL, f"{name}[ARGS]" if name else ""
    elif family == "gemma4":
        markup, seed = GEMMA4, "call:" + (f"{name}{{" if name else "")
    elif family == "minicpm5":
        markup, seed = MINICPM, f'"{name}">' if name else ""
    else:
        quoted = json.dumps(name)[1:-1] if name else ""  # names are checked; JSON all the same
        markup, seed = TOOL_CALL_TAG, '\n{"name": "' + (f'{quoted}", "arguments": ' if name else "")
    return ForcedOpening(markup.start + seed, markup, seed)
