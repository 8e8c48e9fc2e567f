"""Qwen3-Coder and Gemma 4 calls decode in time linear in their length, shown by
counting the work their decoding does, not by timing it; and they decode as they
did when mlx-lm's parsers read the whole markup."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import app.protocol.tool_formats as tf
from app.protocol.tool_formats import GEMMA4, TOOL_CALL_TAG, ToolCall, ToolCallDecoder
from app.protocol.tool_schema import function_tools
from tests.unit.test_linear_scans import CountingText
from tests.unit.test_tool_formats import _outcome

TOOLS = function_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "run",
                "parameters": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}, "env": {"type": "object"}},
                },
            },
        }
    ]
)
N = 2000


def _mlx_lm(name: str) -> Any:
    return importlib.import_module(f"mlx_lm.tool_parsers.{name}")


# -- Qwen3-Coder ---------------------------------------------------------------


def _qwen_regex_work(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The characters mlx-lm's Qwen regex, ``<function=(.*?)</function>$``
    searched for, examines in each text the decoder hands it: one pass where the
    text ends in a closing (it matches from the first opening), else one pass
    from each ``<function=`` in it (each attempt reads on to the end and fails)."""
    work: list[int] = []
    real = tf._mlx_parser

    def parse(text: str, tools: Any = None) -> Any:
        ends = text.endswith(("</function>", "</function>\n"))
        work.append(len(text) * (1 if ends else max(1, text.count("<function="))))
        return real("qwen3_coder")(text, tools)

    monkeypatch.setattr(
        tf, "_mlx_parser", lambda name: parse if name == "qwen3_coder" else real(name)
    )
    return work


_OPENINGS = "<function=" * N


@pytest.mark.parametrize(
    ("inner", "decoded"),
    [
        # a value quoting Qwen markup many times, then text after the call: no call
        (
            f"\n<function=run>\n<parameter=command>\n{_OPENINGS}\n</parameter>\n</function> ok\n",
            None,
        ),
        # a function never closed: no call
        (f"\n<function=run>\n<parameter=command>\nx\n</parameter>\n{_OPENINGS}", None),
        # the same value in a call that is well formed: one call
        (
            f"\n<function=run>\n<parameter=command>\n{_OPENINGS}\n</parameter>\n</function>\n",
            [ToolCall("run", '{"command": "' + _OPENINGS + '"}')],
        ),
    ],
)
def test_qwen_markup_is_read_with_work_linear_in_its_length(monkeypatch, inner, decoded):
    """mlx-lm's regex ran over each function's text, and was tried again from each
    ``<function=`` where the text did not end in a closing: 416 KB held the event
    loop 2.5 s. Each character is now examined a bounded number of times."""
    work = _qwen_regex_work(monkeypatch)
    assert ToolCallDecoder(TOOLS, "qwen3_coder").decode(TOOL_CALL_TAG, inner) == decoded
    assert sum(work) <= 2 * len(inner)


def _qwen_as_before(inner: str) -> list[Any]:
    """The decoding this replaced: mlx-lm's parser on each function's whole piece."""
    pieces = tf._functions(inner)
    for piece in pieces:
        tf._all_closed(piece, "<parameter=", "</parameter>")
    return [_mlx_lm("qwen3_coder").parse_tool_call(piece) for piece in pieces]


_QWEN_PIECES = [
    *("\n<function=run>\n", "<parameter=command>\n", "ls -la\n", "</parameter>\n", "</function>"),
    *("<function=", "</function>\n", "<parameter=", "</parameter>", "run>", "null", "\n", " x "),
    *("<tool_call>", "</tool_call>", "<", ">", "é", "\r"),
]


_QWEN_VALUE = st.lists(
    st.sampled_from(["x", " ", "\n", "<function=", "</function>", "<parameter=", "é", "null", "1"]),
    max_size=5,
).map("".join)
_QWEN_FUNCTION = st.tuples(
    st.sampled_from(["run", "read_file", " run", "a-b"]),
    st.lists(st.tuples(st.sampled_from(["command", "env", "k"]), _QWEN_VALUE), max_size=3),
).map(
    lambda f: (
        f"<function={f[0]}>\n"
        + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in f[1])
        + "</function>"
    )
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(_QWEN_FUNCTION, min_size=1, max_size=3),
    st.sampled_from(["\n", "", " x ", "\n\n"]),
    st.sampled_from(["", "\n", "\n\n", " ok", "<function=", "\n</function>", "x"]),
    st.sampled_from(["\n", "", " "]),
)
def test_qwen_functions_decode_as_before(functions, gap, after, before):
    inner = before + gap.join(functions) + after
    assert _outcome(tf._qwen3_coder, inner) == _outcome(_qwen_as_before, inner)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_QWEN_PIECES), max_size=16).map("".join))
def test_qwen_markup_decodes_as_before(inner):
    assert _outcome(tf._qwen3_coder, inner) == _outcome(_qwen_as_before, inner)


# -- Gemma 4 -------------------------------------------------------------------


def _gemma_call(strings: int) -> str:
    pairs = ",".join(f'k{i}:<|"|>v{{{i}}}<|"|>' for i in range(strings))
    return f'call:run{{command:<|"|>ls<|"|>,env:{{{pairs}}}}}'


def test_gemma_strings_are_read_with_work_linear_in_the_calls_length(monkeypatch):
    """mlx-lm's ``_gemma4_args_to_json`` put each ``<|"|>`` string back with a
    ``replace`` over the whole argument text: 16,000 strings in 533 KB held the
    event loop 3.9 s. Counted: that work (the argument text once per string),
    and the characters the decoder's own scans of the call examine."""
    module = tf._mlx_module("gemma4")
    real = module._gemma4_args_to_json
    replaced: list[int] = []

    def to_json(text: str) -> str:
        replaced.append(len(text) * (1 + text.count('<|"|>') // 2))
        return real(text)

    monkeypatch.setattr(module, "_gemma4_args_to_json", to_json)
    inner = CountingText(_gemma_call(N))
    calls = ToolCallDecoder(TOOLS, "gemma4").decode(GEMMA4, inner)
    assert calls is not None and len(calls) == 1
    assert calls[0].arguments_dict()["env"] == {f"k{i}": f"v{{{i}}}" for i in range(N)}
    assert sum(replaced) <= 2 * len(inner)
    assert inner.examined <= 2 * len(inner)


def _gemma_as_before(inner: str) -> list[Any]:
    """The decoding this replaced: mlx-lm's parser on each call's span."""
    spans = tf._gemma4_spans(inner)
    if not spans:
        raise ValueError("no balanced call")
    return [_mlx_lm("gemma4").parse_tool_call(inner[a:b]) for a, b in spans]


_G4_TEXT = st.text(alphabet='ab {}:,<|">\n\\é', max_size=10).filter(lambda t: '<|"|>' not in t)
_G4_VALUE = st.recursive(
    st.one_of(
        st.integers(-5, 500).map(str),
        st.sampled_from(["true", "false", "null", "1.5", "[]"]),
        _G4_TEXT.map(lambda t: f'<|"|>{t}<|"|>'),
    ),
    lambda inner: st.lists(st.tuples(st.from_regex(r"[a-z_]{1,4}", fullmatch=True), inner)).map(
        lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}"
    ),
    max_leaves=8,
)
_G4_CALL = st.tuples(
    st.sampled_from(["run", "read_file", "a-b"]),
    st.lists(st.tuples(st.from_regex(r"[a-z_]{1,4}", fullmatch=True), _G4_VALUE), max_size=4),
).map(lambda c: f"call:{c[0]}{{" + ",".join(f"{k}:{v}" for k, v in c[1]) + "}")


@settings(max_examples=400, deadline=None)
@given(st.lists(_G4_CALL, min_size=1, max_size=3), st.sampled_from(["", "\n", " x "]))
def test_gemma_calls_decode_as_before_on_well_formed_markup(calls, gap):
    inner = gap.join(calls)
    assert _outcome(tf._gemma4, inner) == _outcome(_gemma_as_before, inner)


_G4_PIECES = [
    *("call:run{", "call:a-b{", "a:", "b_c:", '<|"|>', "x", "}", "{", ",", "1", "true", "[", "]"),
    *("call:", ":", "<", "|", '"', " ", "\n", "é", "\\"),
]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_G4_PIECES), max_size=24).map("".join))
def test_gemma_markup_decodes_as_before(inner):
    assert _outcome(tf._gemma4, inner) == _outcome(_gemma_as_before, inner)
