"""Each tool-call format, from transcripts written to the formats' specs; schema
decoding of argument values; every thinking control."""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.protocol.output_parser import Content, OutputParser, Reasoning, Syntax, merge
from app.protocol.thinking import resolve_thinking
from app.protocol.tool_formats import (
    MINICPM,
    MISTRAL,
    ToolCall,
    ToolCallDecoder,
    forced_opening,
)
from app.protocol.tool_schema import coerce_value, function_tools

TOOLS = function_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string"},
                        "limit": {"type": "integer"},
                        "offset": {"type": ["integer", "null"]},
                    },
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "run",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "command": {"type": "string"},
                        "env": {"type": "object"},
                        "dry_run": {"type": "boolean"},
                        "timeout": {"type": "number"},
                    },
                },
            },
        },
        {"type": "web_search_preview"},  # a built-in tool type: ignored
    ]
)


def parse(text: str, family: str | None = None, in_reasoning: bool = False):
    return OutputParser(
        Syntax(starts_in_reasoning=in_reasoning), ToolCallDecoder(TOOLS, family)
    ).parse(text)


def test_builtin_tool_types_are_dropped():
    assert [t["function"]["name"] for t in TOOLS] == ["read_file", "run"]


def test_qwen3_coder_xml_with_reasoning_and_two_calls():
    text = (
        "<think>\nThe user wants the README.\n</think>\n\n"
        "<tool_call>\n<function=read_file>\n<parameter=path>\n007\n</parameter>\n"
        "<parameter=limit>\n40\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=run>\n<parameter=command>\nls -la | grep '<x>'\n</parameter>\n"
        '<parameter=env>\n{"A": "1"}\n</parameter>\n<parameter=dry_run>\nfalse\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    assert parse(text, "qwen3_coder") == [
        Reasoning("\nThe user wants the README.\n"),
        ToolCall("read_file", '{"path": "007", "limit": 40}'),
        ToolCall(
            "run", '{"command": "ls -la | grep \'<x>\'", "env": {"A": "1"}, "dry_run": false}'
        ),
    ]


def test_qwen3_thinking_prompt_opened_block():
    text = "Need to list files.\n</think>\n\n<tool_call>\n<function=run>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>"
    assert parse(text, "qwen3_coder", in_reasoning=True) == [
        Reasoning("Need to list files.\n"),
        ToolCall("run", '{"command": "ls"}'),
    ]


def test_hermes_qwen25_json():
    text = 'Sure.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", "limit": "10"}}\n</tool_call>'
    assert parse(text, "json_tools") == [
        Content("Sure.\n"),
        ToolCall("read_file", '{"path": "a.py", "limit": 10}'),
    ]


def test_llama_style_parameters_in_a_tool_call_tag_are_the_arguments():
    """A call object naming its arguments "parameters" (Llama's JSON) inside a
    <tool_call> tag ran with no arguments at all."""
    text = '<tool_call>\n{"name": "read_file", "parameters": {"path": "a.py"}}\n</tool_call>'
    assert parse(text, "json_tools") == [ToolCall("read_file", '{"path": "a.py"}')]
    assert parse(text) == [ToolCall("read_file", '{"path": "a.py"}')]


@pytest.mark.parametrize(
    "family, text",
    [
        (
            "glm47",
            "<tool_call>run\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n"
            "<arg_key>env</arg_key>\n<arg_value>A=1\n</tool_call>",
        ),
        ("glm47", "<tool_call>run\n<arg_key>command</arg_key>\n<arg_key>env</arg_key></tool_call>"),
        (
            "minicpm5",
            '<function name="run"><param name="command">ls</param><param name="env">A=1</function>',
        ),
    ],
)
def test_a_call_with_an_argument_left_open_is_text_in_every_xml_markup(family, text):
    """GLM and MiniCPM dropped a parameter never closed and ran the call without
    it (Qwen3-Coder's markup already went out as text)."""
    assert parse(text, family) == [Content(text)]


def test_two_json_calls_in_one_tool_call_block_are_two_calls():
    """Qwen2.5-style models now and then write both calls in one block: one
    json.loads refused it and both calls went out as text."""
    one = '{"name": "read_file", "arguments": {"path": "a"}}'
    two = '{"name": "run", "arguments": {"command": "ls"}}'
    assert parse(f"<tool_call>\n{one}\n{two}\n</tool_call>", "json_tools") == [
        ToolCall("read_file", '{"path": "a"}'),
        ToolCall("run", '{"command": "ls"}'),
    ]
    broken = f"<tool_call>\n{one}\n{two[:-3]}\n</tool_call>"
    assert parse(broken, "json_tools") == [Content(broken)]  # not half of it


def test_glm47_key_values_keep_string_params_strings():
    text = (
        "<think>Check it.</think>"
        "<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>123</arg_value>\n"
        "<arg_key>limit</arg_key>\n<arg_value>5</arg_value>\n</tool_call>"
    )
    assert parse(text, "glm47") == [
        Reasoning("Check it."),
        ToolCall("read_file", '{"path": "123", "limit": 5}'),
    ]


# pydantic's / FastMCP's Optional[str], a type list, a $ref, no type at all, an integer
_RELEASE = function_tools(
    [{"type": "function", "function": {"name": "release", "parameters": {"type": "object",
      "$defs": {"Ref": {"type": "string"}},
      "properties": {
          "version": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
          "tag": {"type": ["string", "null"]},
          "ref": {"$ref": "#/$defs/Ref"},
          "msg": {"anyOf": [{"type": "string"}, {"type": "null"}]},
          "note": {"description": "free text"},
          "count": {"type": "integer"},
      }}}}]
)  # fmt: skip
_RELEASE_ARGS = {
    "version": "1.10",
    "tag": "true",
    "ref": "3",
    "msg": "[1, 2]",
    "note": "7",
    "count": "3",
}
_RELEASE_DECODED = {
    "version": "1.10",
    "tag": "true",
    "ref": "3",
    "msg": "[1, 2]",
    "note": "7",
    "count": 3,
}


@pytest.mark.parametrize(
    ("family", "markup", "tags"),
    [
        ("glm47", None, ("arg_key", "arg_value")),
        (
            "longcat",
            ("<longcat_tool_call>", "</longcat_tool_call>"),
            ("longcat_arg_key", "longcat_arg_value"),
        ),
    ],
)
def test_key_value_markup_keeps_text_where_the_schema_allows_a_string(family, markup, tags):
    """mlx-lm's GLM and LongCat parsers keep a value as text only where its schema
    says exactly "type": "string", and read every other one as JSON or a Python
    literal: Optional[str] "1.10" became 1.1, "true" True, a $ref's "3" 3. Their
    text is typed here, against the whole schema, as Qwen's is."""
    key, value = tags
    pairs = "".join(
        f"<{key}>{k}</{key}>\n<{value}>{v}</{value}>\n" for k, v in _RELEASE_ARGS.items()
    )
    decoder = ToolCallDecoder(_RELEASE, family, markup)
    assert decoder.decode(decoder.markups[0], f"release\n{pairs}") == [
        ToolCall("release", json.dumps(_RELEASE_DECODED))
    ]
    # null written for a parameter that may be null is null; for a string one, its text
    nulls = f"release\n<{key}>version</{key}><{value}>null</{value}>"
    assert decoder.decode(decoder.markups[0], nulls) == [ToolCall("release", '{"version": null}')]
    text = f"release\n<{key}>count</{key}><{value}>x</{value}>"  # not an integer: as written
    assert decoder.decode(decoder.markups[0], text) == [ToolCall("release", '{"count": "x"}')]


def test_glm_key_value_text_keeps_text_and_its_json_stays_typed():
    """GLM's fallbacks: ``name key=value`` is text like its pairs; JSON the model
    typed itself (a null for an Optional[str]) keeps its types."""
    decoder = ToolCallDecoder(_RELEASE, "glm47")
    assert decoder.decode(decoder.markups[0], "release version=1.10 count=2") == [
        ToolCall("release", '{"version": "1.10", "count": 2}')
    ]
    typed = '{"name": "release", "arguments": {"version": null, "count": 2}}'
    assert decoder.decode(decoder.markups[0], typed) == [
        ToolCall("release", '{"version": null, "count": 2}')
    ]


def test_glm_reasoning_without_opening_tag():
    text = "The file is small.</think>Done."
    assert parse(text, "glm47", in_reasoning=True) == [
        Reasoning("The file is small."),
        Content("Done."),
    ]


def test_minicpm_function_blocks_with_cdata():
    text = (
        'Running it.\n<function name="run"><param name="command"><![CDATA[echo "<b>" && exit 1]]></param>'
        '<param name="timeout">2.5</param></function>'
        '<function name="read_file"><param name="path">x.txt</param></function>'
    )
    assert parse(text, "minicpm5") == [
        Content("Running it.\n"),
        ToolCall("run", '{"command": "echo \\"<b>\\" && exit 1", "timeout": 2.5}'),
        ToolCall("read_file", '{"path": "x.txt"}'),
    ]


def test_mistral_json_list_keeps_model_ids():
    text = '[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "a"}, "id": "Abc123xyZ"}, {"name": "run", "arguments": {"command": "ls"}, "id": "Q9w8e7r6T"}]'
    assert parse(text, "mistral") == [
        ToolCall("read_file", '{"path": "a"}', "Abc123xyZ"),
        ToolCall("run", '{"command": "ls"}', "Q9w8e7r6T"),
    ]


def test_mistral_name_args_form():
    text = 'Let me run it.[TOOL_CALLS]run[ARGS]{"command": "make test", "dry_run": true}'
    assert parse(text, "mistral") == [
        Content("Let me run it."),
        ToolCall("run", '{"command": "make test", "dry_run": true}'),
    ]


@pytest.mark.parametrize("gap", ["", " ", "\n\n"])
def test_text_after_a_mistral_call_is_content(gap):
    """What the model wrote after its last call's arguments was in neither the
    reply nor the text kept for the echoed turn."""
    call = '[TOOL_CALLS]run[ARGS]{"command": "ls"}'
    after = "I have called run; it lists the folder."
    text = f"Looking.{call}{gap}{after}"
    expected = [Content("Looking."), ToolCall("run", '{"command": "ls"}'), Content(after)]
    whole = OutputParser(Syntax(), ToolCallDecoder(TOOLS, "mistral"))
    assert whole.parse(text) == expected
    assert whole.kept_text == f"Looking.{gap}{after}"
    streamed = OutputParser(Syntax(), ToolCallDecoder(TOOLS, "mistral"))
    events = [e for c in text for e in streamed.feed(c)] + streamed.finish()
    assert merge(events) == expected
    assert streamed.kept_text == whole.kept_text


def test_llama3_bare_json_and_python_tag():
    assert parse('{"name": "read_file", "parameters": {"path": "/etc/hosts", "limit": 3}}') == [
        ToolCall("read_file", '{"path": "/etc/hosts", "limit": 3}')
    ]
    assert parse('<|python_tag|>{"name": "run", "parameters": {"command": "pwd"}}') == [
        ToolCall("run", '{"command": "pwd"}')
    ]


def test_bare_json_is_a_call_only_for_models_without_a_tool_family():
    text = '{"name": "read_file", "parameters": {"path": "a"}}'
    assert parse(text, "qwen3_coder") == [Content(text)]


def test_a_family_with_its_own_markup_uses_mlx_lms_parser_for_it():
    decoder = ToolCallDecoder(TOOLS, "pythonic", ("<|tool_call_start|>", "<|tool_call_end|>"))
    text = 'Ok.<|tool_call_start|>[read_file(path="a.txt", limit=3)]<|tool_call_end|>'
    assert OutputParser(Syntax(), decoder).parse(text) == [
        Content("Ok."),
        ToolCall("read_file", '{"path": "a.txt", "limit": 3}'),
    ]


def test_llama3_json_answer_that_is_not_a_call_stays_content():
    text = '{"name": "Alice", "parameters": {"age": 3}}'
    assert parse(text) == [Content(text)]


def test_gemma4_calls():
    text = '<|tool_call>call:read_file{path:<|"|>src/a,b{c}.py<|"|>,limit:20}<tool_call|>'
    assert parse(text, "gemma4") == [
        ToolCall("read_file", '{"path": "src/a,b{c}.py", "limit": 20}')
    ]


_G4_TEXT = st.text(alphabet='ab {}:,<|">\n', max_size=12).filter(lambda t: '<|"|>' not in t)
_G4_VALUE = st.one_of(
    st.integers(-5, 500).map(str),
    st.sampled_from(["true", "false", "null"]),
    _G4_TEXT.map(lambda t: f'<|"|>{t}<|"|>'),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["read_file", "run", "x-y"]),
            st.lists(st.tuples(st.sampled_from(["path", "limit", "k_2"]), _G4_VALUE), max_size=3),
        ),
        min_size=1,
        max_size=3,
    ),
    st.sampled_from(["", "\n", " then "]),
)
def test_gemma4_spans_read_what_mlx_lms_regex_reads_on_well_formed_markup(calls, gap):
    import importlib

    from app.protocol.tool_formats import _gemma4_spans

    inner = gap.join(
        f"call:{name}{{" + ",".join(f"{k}:{v}" for k, v in args) + "}" for name, args in calls
    )
    regex = importlib.import_module("mlx_lm.tool_parsers.gemma4")._tool_call_regex
    assert _gemma4_spans(inner) == [m.span() for m in regex.finditer(inner)]


def test_gemma4_calls_never_closed_never_reach_mlx_lms_regex(monkeypatch):
    """Its recursive regex read to the end from every ``call:`` left open: 28 KB
    of them held the event loop 7 s, for a model of any family (every markup is
    recognised whatever the family)."""
    import app.protocol.tool_formats as tf

    seen: list[str] = []
    monkeypatch.setattr(
        tf, "_mlx_parser", lambda name: lambda text: seen.append(text) or {"name": "run"}
    )
    looping = 'call:run{command:<|"|>ls<|"|>}' + "call:run{" * 4000
    calls = ToolCallDecoder(TOOLS, "qwen3_coder").decode(tf.GEMMA4, looping)
    assert calls == [ToolCall("run", '{"command": "ls"}')]  # the one closed call
    assert seen == []  # read here: mlx-lm's regex never runs


def test_qwen3_coder_two_functions_in_one_block_are_two_calls():
    """mlx-lm's parser reads a block as one function: the first one's name with
    the last one's arguments, here reading the wrong file and losing the run."""
    text = (
        "<tool_call>\n<function=read_file>\n<parameter=path>\nnotes.txt\n</parameter>\n"
        "</function>\n<function=run>\n<parameter=command>\nrm -rf build\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    assert parse(text, "qwen3_coder") == [
        ToolCall("read_file", '{"path": "notes.txt"}'),
        ToolCall("run", '{"command": "rm -rf build"}'),
    ]
    # a parameter whose text holds a closing tag, not followed by another function
    one = "<tool_call>\n<function=run>\n<parameter=command>\necho '</function>' x\n</parameter>\n</function>\n</tool_call>"
    assert parse(one, "qwen3_coder") == [ToolCall("run", '{"command": "echo \'</function>\' x"}')]


def test_a_parameter_value_holding_qwen_markup_is_not_cut_into_calls():
    """A file whose text holds a function seam ("</function>\\n<function=") is one
    argument: it became the call without its content and a call never declared."""
    text = (
        "<tool_call>\n<function=run>\n<parameter=command>\ncat <<EOF\n</function>\n<function=demo>\nEOF\n"
        "</parameter>\n</function>\n</tool_call>"
    )
    assert parse(text, "qwen3_coder") == [
        ToolCall("run", json.dumps({"command": "cat <<EOF\n</function>\n<function=demo>\nEOF"}))
    ]


@pytest.mark.parametrize(
    "body",
    [
        # no </parameter> after the path: the command ran into it
        "<parameter=path>\nnotes.txt\n<parameter=limit>\n5\n</parameter>\n",
        # a parameter never closed at all: mlx-lm's parser dropped it
        "<parameter=path>\nnotes.txt\n",
    ],
)
def test_a_qwen3_coder_call_missing_a_parameter_close_stays_text(body):
    """Run as decoded, it read a file named "notes.txt\\n<parameter=limit>..." (or
    none): an agent acting on corrupted arguments. Left as text, the client sees it."""
    text = f"<tool_call>\n<function=read_file>\n{body}</function>\n</tool_call>"
    assert parse(text, "qwen3_coder") == [Content(text)]
    # a value holding another function's parameter markup, its own all given, is fine
    quoted = (
        "<tool_call>\n<function=run>\n<parameter=command>\necho '<parameter=path>'\n"
        "</parameter>\n</function>\n</tool_call>"
    )
    assert parse(quoted, "qwen3_coder") == [
        ToolCall("run", json.dumps({"command": "echo '<parameter=path>'"}))
    ]


def test_text_valued_markup_of_a_familys_own_parser_decodes_untyped_json():
    """MiniMax-M2 writes every value as text: a $ref parameter's JSON is the object."""
    tools = function_tools(
        [{"type": "function", "function": {"name": "event", "parameters": {"type": "object",
          "properties": {"slot": {"$ref": "#/$defs/Slot"}}}}}]
    )  # fmt: skip
    decoder = ToolCallDecoder(tools, "minimax_m2", ("<minimax:tool_call>", "</minimax:tool_call>"))
    inner = '\n<invoke name="event">\n<parameter name="slot">{"start": "10:00"}</parameter>\n</invoke>\n'
    assert decoder.decode(decoder.markups[0], inner) == [
        ToolCall("event", '{"slot": {"start": "10:00"}}')
    ]


@pytest.mark.parametrize("family", [None, "json_tools", "mistral"])
def test_json_markup_keeps_a_string_the_model_wrote_for_an_untyped_parameter(family):
    """Only markup that writes every value as text has its untyped values decoded:
    in JSON the model typed the value itself (here a file's JSON text)."""
    tools = function_tools(
        [{"type": "function", "function": {"name": "write", "parameters": {"type": "object",
          "properties": {"content": {"description": "the text"}}}}}]
    )  # fmt: skip
    args = {"content": '{"debug": true}'}
    if family == "mistral":
        text = "[TOOL_CALLS]" + json.dumps([{"name": "write", "arguments": args}])
    else:
        text = "<tool_call>" + json.dumps({"name": "write", "arguments": args}) + "</tool_call>"
    calls = OutputParser(Syntax(), ToolCallDecoder(tools, family)).parse(text)
    assert calls == [ToolCall("write", json.dumps(args))]
    xml = "<tool_call>\n<function=write>\n<parameter=content>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
    xml_calls = OutputParser(Syntax(), ToolCallDecoder(tools, "qwen3_coder")).parse(xml)
    assert xml_calls == [ToolCall("write", '{"content": [1, 2]}')]  # text: decoded


def test_glm_reads_other_markup_and_prose_is_no_call():
    """GLM's parser turns any text into a call; one that is not falls through to
    the parser that reads it, or stays text."""
    qwen = "<tool_call>\n<function=run>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>"
    assert parse(qwen, "glm47") == [ToolCall("run", '{"command": "ls"}')]
    prose = "<tool_call>I will not call anything</tool_call>"
    assert parse(prose, "glm47") == [Content(prose)]
    assert parse("<tool_call>run</tool_call>", "glm47") == [ToolCall("run", "{}")]


def test_broken_markup_falls_back_to_content():
    text = "<tool_call>\n{not json at all\n</tool_call> and more"
    assert parse(text) == [Content(text)]


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("42", {"type": "string"}, "42"),
        (42, {"type": "string"}, "42"),
        ("42", {"type": "integer"}, 42),
        ("4.0", {"type": "integer"}, 4),
        ("4.5", {"type": "integer"}, "4.5"),
        ("4.5", {"type": "number"}, 4.5),
        ("nan", {"type": "number"}, "nan"),
        ("TRUE", {"type": "boolean"}, True),
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("null", {"type": ["integer", "null"]}, None),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7),
        ("a", {"enum": ["a", "b"]}, "a"),
        ("x", None, "x"),
        # a client's schema of any shape, and values past the parsers' limits
        ("7", {"anyOf": 5}, "7"),
        ("7", {"oneOf": True, "anyOf": [{"type": "integer"}]}, 7),
        ("9" * 5000, {"type": "integer"}, "9" * 5000),
        ("[" * 5000 + "]" * 5000, {"type": "array"}, "[" * 5000 + "]" * 5000),
        # typed by reference or by shape (pydantic's and MCP's schemas): JSON, not a string
        ('{"mode": "w"}', {"$ref": "#/$defs/Opts"}, {"mode": "w"}),
        ('{"a": 1}', {"anyOf": [{"$ref": "#/$defs/Opts"}, {"type": "null"}]}, {"a": 1}),
        ("null", {"anyOf": [{"$ref": "#/$defs/Opts"}, {"type": "null"}]}, None),
        ("[1, 2]", {"items": {"type": "integer"}}, [1, 2]),
        ('{"a": 1}', {"properties": {"a": {}}}, {"a": 1}),
        ('{"a": 1}', {"allOf": [{"type": "object"}]}, {"a": 1}),
        ('{"a": 1}', {"description": "anything"}, {"a": 1}),
        ("plain words", {"$ref": "#/$defs/Name"}, "plain words"),
        ("3", {"$ref": "#/$defs/Count"}, "3"),  # a number only where the schema says so
    ],
)
def test_values_decode_against_the_schema(value, schema, expected):
    assert coerce_value(value, schema) == expected


@pytest.mark.parametrize("text", ["null", "Null", "NULL"])
def test_a_string_argument_written_null_is_that_text(text):
    """mlx-lm's XML parsers read any casing of "null" as null before a schema is
    looked at: a file whose content is "null" was written as nothing. A nullable
    or object parameter written null is still null."""
    args = json.dumps({"command": text, "env": None})
    qwen = (
        f"<tool_call>\n<function=run>\n<parameter=command>\n{text}\n</parameter>\n"
        "<parameter=env>\nnull\n</parameter>\n</function>\n</tool_call>"
    )
    assert parse(qwen, "qwen3_coder") == [ToolCall("run", args)]
    for value in (text, f" <![CDATA[{text}]]> "):
        minicpm = (
            f'<function name="run"><param name="command">{value}</param>'
            '<param name="env">null</param></function>'
        )
        assert parse(minicpm, "minicpm5") == [ToolCall("run", args)]
    nullable = "<tool_call>\n<function=read_file>\n<parameter=offset>\nNull\n</parameter>\n"
    assert parse(nullable + "</function>\n</tool_call>", "qwen3_coder") == [
        ToolCall("read_file", '{"offset": null}')
    ]


@given(st.text(st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=24))
@settings(max_examples=300, deadline=None)
def test_a_qwen_string_argument_is_the_text_written(text):
    markup = (
        f"<tool_call>\n<function=run>\n<parameter=command>\n{text}\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    (call,) = parse(markup, "qwen3_coder")
    assert isinstance(call, ToolCall) and json.loads(call.arguments) == {"command": text}


def test_a_call_against_a_malformed_schema_still_decodes():
    tools = function_tools(
        [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"anyOf": 5}}},
                },
            }
        ]
    )
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    parser = OutputParser(Syntax(), ToolCallDecoder(tools, "json_tools"))
    assert parser.parse(text) == [ToolCall("get_weather", '{"city": "Oslo"}')]


@pytest.mark.parametrize("args", ['{"x": NaN}', '{"x": 1e999}', '{"x": -Infinity}'])
def test_a_call_whose_arguments_are_not_finite_json_stays_text(args):
    """A client could not parse such arguments: the markup is passed on as text."""
    text = f'<tool_call>\n{{"name": "run", "arguments": {args}}}\n</tool_call>'
    assert parse(text, "json_tools") == [Content(text)]


def test_a_forced_call_names_its_function_as_json():
    opening = forced_opening(None, 'look"up')
    assert opening.text.endswith('{"name": "look\\"up", "arguments": ')


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"enable_thinking": False}, False),
        ({"chat_template_kwargs": {"enable_thinking": False}, "enable_thinking": True}, False),
        ({"thinking": True}, True),
        ({"thinking": "off"}, False),
        ({"thinking": "xhigh"}, True),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, True),
        ({"thinking": {"type": "disabled"}}, False),
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "low"}, True),
        ({"reasoning": {"effort": "minimal"}}, True),
        ({"reasoning": {"effort": "none"}}, False),
        ({"metadata": {"enable_thinking": False}}, False),
        ({"extra_body": {"reasoning_effort": "none"}, "metadata": {"thinking": "on"}}, False),
        ({"thinking": "banana"}, None),
    ],
)
def test_every_thinking_control_maps_onto_one_flag(fields, expected):
    for default in (True, False):
        want = default if expected is None else expected
        assert resolve_thinking(fields, default) is want


_GLM_TEXT = st.text(st.sampled_from("ab \n<>/=_\\n"), max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["read_file", "run", " run\n"]),
    st.lists(st.tuples(_GLM_TEXT, st.sampled_from(["", " ", "\n", "\\n", " \\n\n"]), _GLM_TEXT)),
)
def test_glm_pairs_read_what_mlx_lms_regex_reads_on_well_formed_markup(name, pairs):
    """The one-pass rebuild hands mlx-lm's GLM parser exactly the pairs its regex
    would find in well-formed markup, so the parse is unchanged."""
    import importlib

    from app.protocol.tool_formats import _glm_pairs

    def clean(text: str) -> str:  # a key or value holding no closing tag of its own
        return text.replace("</arg_key>", "").replace("</arg_value>", "")

    inner = name + "".join(
        f"<arg_key>{clean(k)}</arg_key>{gap}<arg_value>{clean(v)}</arg_value>"
        for k, gap, v in pairs
    )
    if "</arg_key" in inner.replace("</arg_key>", "") or "</arg_value" in inner.replace(
        "</arg_value>", ""
    ):
        return  # a partial tag spliced across the join: not what this property covers
    parse = importlib.import_module("mlx_lm.tool_parsers.glm47").parse_tool_call
    assert parse(_glm_pairs(inner), TOOLS) == parse(inner, TOOLS)


def test_glm_markup_a_model_loops_on_reaches_mlx_lms_parser_without_its_open_pairs(
    monkeypatch,
):
    """Pairs left open made mlx-lm's regex backtrack over the tail for each one:
    64 KB of them held the event loop for minutes. Found open in one pass, they
    make the markup no call (an argument would be missing): the regex never runs."""
    import app.protocol.tool_formats as tf

    seen = []
    monkeypatch.setattr(
        tf,
        "_mlx_parser",
        lambda name: lambda text, tools=None: seen.append(text) or {"name": "run", "arguments": {}},
    )
    loop = "<arg_key>command</arg_key><arg_value>ls" * 2000
    inner = "run\n<arg_key>path</arg_key>\n<arg_value>a.txt</arg_value>" + loop
    assert not ToolCallDecoder(TOOLS, "glm47").decode(tf.TOOL_CALL_TAG, inner)
    assert seen == []


def test_decoding_calls_imports_no_mlx():
    """mlx-lm's parsers were imported through mlx_lm, which imports MLX and makes
    streams on the parsing thread (the HTTP event loop): that thread's MLX
    thread-locals ran their destructors during interpreter shutdown and now and
    then aborted the process at exit (pytest ended with 134 one run in four)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from app.protocol.output_parser import OutputParser, Syntax\n"
        "from app.protocol.tool_formats import ToolCallDecoder\n"
        "tools = [{'type': 'function', 'function': {'name': 'run', 'parameters': {}}}]\n"
        "for family in ('qwen3_coder', 'glm47', 'minicpm5', 'mistral', None):\n"
        "    OutputParser(Syntax(), ToolCallDecoder(tools, family)).parse(\n"
        "        '<tool_call>\\n<function=run>\\n<parameter=command>\\nls\\n</parameter>\\n'\n"
        "        '</function>\\n</tool_call>')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_a_clients_schema_is_walked_once_per_request_not_per_decoded_call(monkeypatch):
    """Decoding runs on the event loop: a parameter of 120,000 anyOf branches was
    walked again for every call the model made (60 ms each)."""
    import app.protocol.tool_schema as ts

    tools = function_tools(
        [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {
                        "type": "object",
                        "properties": {"a": {"anyOf": [{"type": "integer"}, {}] * 500}},
                    },
                },
            }
        ]
    )
    decoder = ToolCallDecoder(tools, "qwen3_coder")  # in the request's preparation
    walked = []
    real = ts._types
    monkeypatch.setattr(ts, "_types", lambda schema: walked.append(1) or real(schema))
    call = "<tool_call>\n<function=f>\n<parameter=a>\n7\n</parameter>\n</function>\n</tool_call>"
    parser = OutputParser(Syntax(), decoder)
    assert parser.parse(call * 8) == [ToolCall("f", '{"a": 7}')] * 8
    assert walked == []


# Decoding runs on the event loop when a reply ends, for markup of any family
# (every markup is recognised whatever the model): it must be linear in its length.


def _growth(decode: Callable[[int], object], n: int) -> float:
    """How many times longer ``decode(4 * n)`` takes than ``decode(n)``, the best of
    three runs each (a busy machine only ever slows a run): about 4 when linear,
    16 when quadratic."""

    def best(size: int) -> float:
        times = []
        for _ in range(3):
            began = time.perf_counter()
            decode(size)
            times.append(time.perf_counter() - began)
        return min(times)

    decode(n)  # parsers imported, patterns compiled
    return best(4 * n) / best(n)


def _outcome(parse: Callable[[str], Any], text: str) -> list[Any] | None:
    """A parser's calls as a list, or None where it raised (decoding: no call)."""
    try:
        out = parse(text)
    except Exception:  # noqa: BLE001 - any error is "no call" to the decoder
        return None
    return out if isinstance(out, list) else [out]


def _mlx_lm(name: str) -> Callable[..., Any]:
    return importlib.import_module(f"mlx_lm.tool_parsers.{name}").parse_tool_call


def _mistral_prose(n: int) -> str:
    """After ``[TOOL_CALLS]`` in prose: a long hex string, and a header further on."""
    return " then " + "0123456789abcdef" * (n // 16) + ". e.g. run[ARGS]{}"


def test_a_mistral_header_after_a_long_word_is_found_in_linear_time():
    """mlx-lm's header regex backtracked through the whole word from each of its
    characters: 16 KB of hex held the event loop 6 s."""
    decoder = ToolCallDecoder(TOOLS, "qwen3_coder")
    assert decoder.decode(MISTRAL, _mistral_prose(64)) == [ToolCall("run", "{}")]  # as mlx-lm
    assert _growth(lambda n: decoder.decode(MISTRAL, _mistral_prose(n)), 2000) < 8


def _many_words(n: int) -> str:
    """Ordinary prose after ``[TOOL_CALLS]``: short words, no header."""
    return "the model writes a reply about tool calls " * (n // 42)


def _words_then_header(n: int) -> str:
    """Short words, then a header at the very end."""
    return "a " * (n // 2) + "f[ARGS]{}"


@pytest.mark.parametrize("prose", [_many_words, _words_then_header])
def test_mistral_prose_of_short_words_is_read_in_linear_time(prose):
    """Looking for ``[ARGS]`` after each word with an anchored ``regex`` match
    scanned the rest of the text for the literal each time: 64 KB of prose held
    the event loop a sixth of a second, 80 KB of "a " two thirds."""
    decoder = ToolCallDecoder(TOOLS, "qwen3_coder")
    assert _growth(lambda n: decoder.decode(MISTRAL, prose(n)), 8000) < 8


_MISTRAL_PIECES = [
    *("run", "a-b", "-", "1", "é", "\u0301", "²", " ", "\n", "\x1c", ",", '"', "[", "]"),
    *("[ARGS]", "[ARGS", "ARGS]", "[TOOL_CALLS]", "{}", "{", "}", '{"x": 1}', '"arguments"'),
    '{"name": "f", "arguments": {}}',
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_MISTRAL_PIECES), max_size=12).map("".join))
def test_mistral_decodes_what_mlx_lms_parser_decodes(text):
    from app.protocol.tool_formats import _mistral

    assert _outcome(_mistral, text) == _outcome(_mlx_lm("mistral"), text)


def _minicpm_prose(n: int) -> str:
    """After ``<function name=`` in prose: a long base64 string, and a ``>`` later."""
    return " " + "QUJD" * (n // 4) + " -> see above"


def test_prose_naming_minicpm_markup_is_read_in_linear_time():
    """mlx-lm's search for a function header ran its name pattern from each
    character of the string: 16 KB of base64 held the event loop 6 s."""
    decoder = ToolCallDecoder(TOOLS, "qwen3_coder")
    assert _growth(lambda n: decoder.decode(MINICPM, _minicpm_prose(n)), 2000) < 8


def test_prose_naming_minicpm_markup_is_no_call():
    """No header where the function starts: the search found "->" and called "-"."""
    text = "The format is <function name=" + _minicpm_prose(64)
    assert parse(text, "qwen3_coder") == [Content(text)]


def _mlx_lm_minicpm(text: str) -> Any:
    """What decoding MiniCPM markup gave before: mlx-lm's parser on all of it."""
    from app.protocol.tool_formats import _all_closed

    _all_closed(text, "<param", "</param>")
    return _mlx_lm("minicpm5")(text.rstrip(), None)


_MINICPM_NAME = st.sampled_from(["run", "a-b", "read_file"]).flatmap(
    lambda name: st.sampled_from([f'"{name}"', f"'{name}'", name, f'"{name}" '])
)
_MINICPM_VALUE = st.text(st.sampled_from('ab 1{}"<>\n'), max_size=8).filter(
    lambda v: "</param" not in v and "<param" not in v and "</function" not in v
)
_MINICPM_PARAM = st.tuples(_MINICPM_NAME, _MINICPM_VALUE, st.booleans()).map(
    lambda p: f"<param name={p[0]}>" + (f"<![CDATA[{p[1]}]]>" if p[2] else p[1]) + "</param>"
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(_MINICPM_NAME, st.lists(_MINICPM_PARAM, max_size=3)), min_size=1),
    st.sampled_from(["", "\n", " "]),
)
def test_minicpm_decodes_what_mlx_lms_parser_decodes_on_well_formed_markup(functions, gap):
    from app.protocol.tool_formats import _minicpm

    # the markup's start, "<function name=", is not part of what is decoded
    text = gap.join(f"<function name={n}>" + "".join(ps) + "</function>" for n, ps in functions)
    inner = text.removeprefix("<function name=")
    assert _outcome(_minicpm, inner) == _outcome(_mlx_lm_minicpm, inner) is not None


_MINICPM_PIECES = [
    *('"f">', "<function name=", "</function>", "<param name=", '"a"', "a>", ">", "</param>"),
    *("x", " ", "\n", "'", '"', "<", "=", "name", "->", "é", "\x1c", "<![CDATA[", "]]>"),
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_MINICPM_PIECES), max_size=12).map("".join))
def test_minicpm_markup_decodes_as_mlx_lm_did_or_is_no_call(text):
    """Text with no header where a function starts is no call; any other text
    decodes as mlx-lm's parser decoded it."""
    from app.protocol.tool_formats import _minicpm

    ours = _outcome(_minicpm, text)
    assert ours is None or ours == _outcome(_mlx_lm_minicpm, text)


_K3 = ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>")
_K3_CALL = '<|open|>call tool="run"<|sep|><|open|>argument key="command"<|sep|>ls<|close|>argument<|sep|><|close|>call<|sep|>'


_K3_OPEN_CALL = '<|open|>call tool="run"<|sep|>'


@pytest.mark.parametrize(
    ("opening", "loop", "closing", "n"),
    [
        ("", "<|open|>call", "", 2000),  # attributes never ended
        ("", "<|open|>call<|sep|>", "", 16000),  # calls never closed
        (_K3_OPEN_CALL, "<|open|>argument", "<|close|>call<|sep|>", 2000),
        (_K3_OPEN_CALL, "<|open|>json<|sep|>", "<|close|>call<|sep|>", 16000),
    ],
)
def test_kimi_k3_markup_a_model_loops_on_is_read_in_linear_time(opening, loop, closing, n):
    """mlx-lm's regexes read to the end from every opening never closed: 16 KB of
    ``<|open|>call`` held the event loop half a second, 64 KB of them 9 s."""
    decoder = ToolCallDecoder(TOOLS, "kimi_k3", _K3)

    def decode(size: int) -> list[ToolCall] | None:
        looping = opening + loop * (size // len(loop)) + closing
        return decoder.decode(decoder.markups[0], _K3_CALL + looping)

    calls = [ToolCall("run", '{"command": "ls"}')] + [ToolCall("run", "{}")] * bool(closing)
    assert decode(n) == calls  # as mlx-lm: a call closed around a loop has no arguments
    assert _growth(decode, n) < 8


_K3_NAME = st.sampled_from(["run", "a&quot;b", "x y"])
_K3_VALUE = st.text(st.sampled_from('ab 1{}[]"<|>\n'), max_size=8).filter(lambda v: "<|" not in v)
_K3_ARGUMENT = st.tuples(
    _K3_NAME, st.sampled_from(["", ' type="string"', ' type="integer"']), _K3_VALUE
).map(lambda a: f'<|open|>argument key="{a[0]}"{a[1]}<|sep|>{a[2]}<|close|>argument<|sep|>')
_K3_ARGUMENTS = st.one_of(
    st.lists(_K3_ARGUMENT, max_size=3).map("".join),
    st.sampled_from(['{"a": 1}', "[1]", "{"]).map(
        lambda j: f"<|open|>json<|sep|>{j}<|close|>json<|sep|>"
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(_K3_NAME, st.sampled_from(["", ' index="1"']), _K3_ARGUMENTS), min_size=1),
    st.sampled_from(["", "\n", " "]),
)
def test_kimi_k3_decodes_what_mlx_lms_parser_decodes_on_well_formed_markup(calls, gap):
    from app.protocol.family_parsers import kimi_k3

    text = gap.join(
        f'<|open|>call tool="{name}"{index}<|sep|>{body}<|close|>call<|sep|>'
        for name, index, body in calls
    )
    assert _outcome(kimi_k3, text) == _outcome(_mlx_lm("kimi_k3"), text)


_K3_PIECES = [
    *("<|open|>call", "<|open|>", "call", "<|sep|>", "<|close|>call<|sep|>", "<|close|>"),
    *('<|open|>call tool="run"<|sep|>', '<|open|>argument key="a"<|sep|>'),
    *("<|open|>argument", "<|close|>argument<|sep|>", "<|open|>json", "<|close|>json<|sep|>"),
    *(' tool="run"', ' key="a"', ' type="string"', ' type="integer"', " tool=", '"', "=", "tool"),
    *("1", '{"a": 1}', "[]", " ", "é", "\u0301", "&quot;", "x"),
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_K3_PIECES), max_size=16).map("".join))
def test_kimi_k3_decodes_any_text_as_mlx_lms_parser_does(text):
    from app.protocol.family_parsers import kimi_k3

    assert _outcome(kimi_k3, text) == _outcome(_mlx_lm("kimi_k3"), text)


_MUSE = ("<atem:function_calls>", "</atem:function_calls>")
_MUSE_CALL = (
    '<atem:invoke name="run"><atem:parameter name="command">ls</atem:parameter></atem:invoke>'
)
_MUSE_OPEN_CALL = '<atem:invoke name="run">'


@pytest.mark.parametrize(
    ("opening", "loop", "closing", "n"),
    [
        ("", "<atem:invoke name", "", 2000),  # openings never ended
        (_MUSE_OPEN_CALL, "<atem:parameter ", "", 2000),  # parameters never closed
        (_MUSE_OPEN_CALL, '<atem:parameter name="a"', "</atem:parameter>", 1000),
    ],
)
def test_muse_spark_markup_a_model_loops_on_is_read_in_linear_time(opening, loop, closing, n):
    """mlx-lm's regexes read to the end from every opening never ended or closed:
    16 KB of ``<atem:invoke name`` held the event loop a quarter second, 16 KB of
    ``<atem:parameter name="a"`` 8 s."""
    decoder = ToolCallDecoder(TOOLS, "muse_spark", _MUSE)

    def decode(size: int) -> list[ToolCall] | None:
        looping = opening + loop * (size // len(loop)) + closing
        return decoder.decode(decoder.markups[0], _MUSE_CALL + looping)

    calls = [ToolCall("run", '{"command": "ls"}')] + [ToolCall("run", "{}")] * bool(opening)
    assert decode(n) == calls  # as mlx-lm: a call around a loop has no arguments
    assert _growth(decode, n) < 8


_MUSE_NAME = st.sampled_from(["run", "a b", "x>y", "k_2"])
_MUSE_VALUE = st.text(st.sampled_from('ab 1{}[]"<>\n'), max_size=8).filter(
    lambda v: "</atem:" not in v
)
_MUSE_PARAMETER = st.tuples(_MUSE_NAME, st.sampled_from(["", ' type="string"']), _MUSE_VALUE).map(
    lambda p: f'<atem:parameter name="{p[0]}"{p[1]}>{p[2]}</atem:parameter>'
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(_MUSE_NAME, st.lists(_MUSE_PARAMETER, max_size=3), st.booleans()), min_size=1
    ),
    st.sampled_from(["", "\n", " "]),
)
def test_muse_spark_decodes_what_mlx_lms_parser_decodes_on_well_formed_markup(calls, gap):
    from app.protocol.family_parsers import muse_spark

    text = gap.join(
        f'<atem:invoke name="{name}">' + "".join(ps) + "</atem:invoke>" * closed
        for name, ps, closed in calls
    )
    assert _outcome(muse_spark, text) == _outcome(_mlx_lm("muse_spark"), text) is not None


_MUSE_PIECES = [
    *("<atem:invoke", ' name="f">', '<atem:invoke name="g">', "</atem:invoke>", "<atem:parameter"),
    *('<atem:parameter name="a">', "</atem:parameter>", ' name="', 'name="', '"', ">", '">'),
    *(" ", "\n", "x", "é", "\u0301", "1", '{"a": 1}', "s", "<", "=", "name", 'b"', "_"),
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_MUSE_PIECES), max_size=16).map("".join))
def test_muse_spark_decodes_any_text_as_mlx_lms_parser_does(text):
    from app.protocol.family_parsers import muse_spark

    assert _outcome(muse_spark, text) == _outcome(_mlx_lm("muse_spark"), text)


_LONGCAT = ("<longcat_tool_call>", "</longcat_tool_call>")
_LONGCAT_TAGS = ("longcat_arg_key", "longcat_arg_value")


def _longcat_pair(key: str, value: str, gap: str = "") -> str:
    return f"<longcat_arg_key>{key}</longcat_arg_key>{gap}<longcat_arg_value>{value}</longcat_arg_value>"


@pytest.mark.parametrize(
    "loop",
    [
        "<longcat_arg_key>a</longcat_arg_key><longcat_arg_value>x",  # values left open
        "<longcat_arg_key>a</longcat_arg_key>x",  # keys with no value
        "<longcat_arg_key>a",  # keys left open
    ],
)
def test_longcat_pairs_a_model_loops_on_are_read_in_linear_time(loop):
    """mlx-lm's LongCat pair regex (GLM's, under other tags) backtracked over the
    tail for each pair left open: 64 KB of them held the event loop 5 s. Found
    open in one pass, they make the markup no call, as GLM's (mlx-lm called the
    function with the argument missing)."""
    decoder = ToolCallDecoder(TOOLS, "longcat", _LONGCAT)

    def decode(size: int) -> list[ToolCall] | None:
        text = "run\n" + _longcat_pair("command", "ls") + loop * (size // len(loop))
        return decoder.decode(decoder.markups[0], text)

    assert _growth(decode, 2000) < 8
    assert decode(0) == [ToolCall("run", '{"command": "ls"}')]
    assert decode(2000) is None


def _mlx_lm_longcat(text: str) -> Any:
    return _mlx_lm("longcat")(text, TOOLS)


def _our_longcat(text: str) -> Any:
    from app.protocol.tool_formats import _glm_pairs

    return _mlx_lm("longcat")(_glm_pairs(text, *_LONGCAT_TAGS), TOOLS)


_LONGCAT_TEXT = st.text(st.sampled_from("ab 1{}[]\"'<>/=_\n\\n\x1c\x85"), max_size=10).filter(
    lambda t: "</longcat_arg" not in t
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["read_file", "run", " run\n", "", '{"name": "run"}']),
    st.lists(
        st.tuples(
            _LONGCAT_TEXT, st.sampled_from(["", " ", "\n", "\\n", " \\n\n", "\x85"]), _LONGCAT_TEXT
        ),
        max_size=4,
    ),
    st.sampled_from(["", "\n", " x "]),
)
def test_longcat_decodes_what_mlx_lms_parser_decodes_on_well_formed_markup(name, pairs, between):
    text = name + between.join(_longcat_pair(k, v, gap) for k, gap, v in pairs)
    if "</longcat_arg" in text.replace("</longcat_arg_key>", "").replace(
        "</longcat_arg_value>", ""
    ):
        return  # a partial tag spliced across the join: not what this property covers
    assert _outcome(_our_longcat, text) == _outcome(_mlx_lm_longcat, text)


_LONGCAT_PIECES = [
    *("<longcat_arg_key>", "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>"),
    *("<longcat_arg_key", "</longcat_arg_value", "run", "a", "1", '"x"', "{", "}", '{"a": 1}'),
    *(" ", "\n", "\\n", "\x1c", "\x85", "é", "<", ">", "/"),
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_LONGCAT_PIECES), max_size=14).map("".join))
def test_longcat_markup_decodes_as_mlx_lm_does_or_is_no_call(text):
    """Any text decodes as mlx-lm's parser decodes it, or is no call where a pair
    is left open or a key has no value (mlx-lm dropped that argument, or read a
    key running through another pair's tags)."""
    ours = _outcome(_our_longcat, text)
    assert ours is None or ours == _outcome(_mlx_lm_longcat, text)


_FUNCTION_GEMMA = ("<start_function_call>", "<end_function_call>")


@pytest.mark.parametrize(
    ("loop", "closing", "n"),
    [
        ("call:a{", "", 4000),  # calls never closed
        ("call:aaaaaaaaaaaaaaaa", "", 16000),  # names with no arguments
        # many arguments: mlx-lm copied the rest at each one (quadratic, but memcpy:
        # 4.6 s only at 1 MB), guarded here
        ("k:1,", "}", 16000),
        ("k:<escape>v<escape>,", "}", 16000),
    ],
)
def test_function_gemma_markup_a_model_loops_on_is_read_in_linear_time(loop, closing, n):
    """mlx-lm's regex read to the end from every ``call:NAME{`` never closed:
    64 KB of ``call:a{`` held the event loop a second."""
    decoder = ToolCallDecoder(TOOLS, "function_gemma", _FUNCTION_GEMMA)

    def decode(size: int) -> list[ToolCall] | None:
        opening = "call:run{" if closing else "call:run{command:ls} "
        looping = loop * (size // len(loop))
        return decoder.decode(decoder.markups[0], opening + looping + closing)

    assert _growth(decode, n) < 8
    if not closing:
        assert decode(n) == [ToolCall("run", '{"command": "ls"}')]  # the first call, as mlx-lm


def _gemma_value(escaped: bool) -> st.SearchStrategy[str]:
    if escaped:
        return st.text(st.sampled_from('ab 1:,{"\n'), max_size=6).map(
            lambda v: f"<escape>{v}<escape>"
        )
    return st.sampled_from(["1", "true", '"x"', "[1]", "a b", "", "{", "null", "-2.5"])


_GEMMA_ARGUMENT = st.tuples(
    st.sampled_from(["command", "a", "x_1", "é"]), st.booleans().flatmap(_gemma_value)
).map(lambda a: f"{a[0]}:{a[1]}")


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["", "Sure. ", "call: ", "call:x ", "call:{"]),
    st.lists(
        st.tuples(st.sampled_from(["run", "a1", "é_x", "read_file"]), st.lists(_GEMMA_ARGUMENT)),
        min_size=1,
        max_size=3,
    ),
    st.sampled_from(["", "\n", " "]),
)
def test_function_gemma_decodes_what_mlx_lms_parser_decodes_on_well_formed_markup(
    prose, calls, gap
):
    from app.protocol.family_parsers import function_gemma

    text = prose + gap.join(f"call:{name}{{{','.join(args)}}}" for name, args in calls)
    assert _outcome(function_gemma, text) == _outcome(_mlx_lm("function_gemma"), text)


_GEMMA_PIECES = [
    *("call:", "call", ":", "run", "a", "é", "\u0301", "²", "-", "{", "}", "call:run{", ","),
    *("<escape>", "1", '"x"', " ", "\n", "k:", "k:<escape>", "call:a{", "true", "["),
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_GEMMA_PIECES), max_size=14).map("".join))
def test_function_gemma_decodes_any_text_as_mlx_lms_parser_does(text):
    from app.protocol.family_parsers import function_gemma

    assert _outcome(function_gemma, text) == _outcome(_mlx_lm("function_gemma"), text)


_PYTHONIC = ("<|tool_call_start|>", "<|tool_call_end|>")


@pytest.mark.parametrize(
    ("opening", "loop", "closing", "n"),
    [
        ("", "[a(", "", 4000),  # calls never closed
        ("", "[a(x=", "", 4000),
        # arguments that are not Python, read by the argument regex: linear in
        # mlx-lm too, guarded here
        ("[run(", "command=ls, ", ")] ]", 8000),
        ("[run(", 'command="a" b, ', ")] ]", 8000),
        ("[run(", "x" * 64 + " ", ")] ]", 16000),  # long words with no "="
    ],
)
def test_pythonic_markup_a_model_loops_on_is_read_in_linear_time(opening, loop, closing, n):
    """mlx-lm's regex read to the end from every ``[name(`` never closed: 64 KB
    of ``[a(`` held the event loop a quarter second."""
    decoder = ToolCallDecoder(TOOLS, "pythonic", _PYTHONIC)

    def decode(size: int) -> list[ToolCall] | None:
        return decoder.decode(decoder.markups[0], opening + loop * (size // len(loop)) + closing)

    assert _growth(decode, n) < 8
    assert (decode(n) is None) == (not closing)  # as mlx-lm: no call, or one to run


_PY_ARG_VALUE = st.sampled_from(
    ['"x"', "'y, z'", "1", "-2.5", "True", "true", "None", "[1, 2]", '{"a": 1}', "a b", "ls -l"]
)
_PY_ARGUMENT = st.tuples(st.sampled_from(["command", "a", "x_1", "é"]), _PY_ARG_VALUE).map(
    lambda a: f"{a[0]}={a[1]}"
)
_PY_CALL = st.tuples(
    st.sampled_from(["run", "a.b", "read_file", "é2"]),
    st.lists(_PY_ARGUMENT, max_size=3),
    st.sampled_from([", ", ",", ",\n"]),
).map(lambda c: f"{c[0]}({c[2].join(c[1])})")


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["", "Sure. ", "[", "[x] "]),
    st.lists(_PY_CALL, min_size=1, max_size=3),
    st.sampled_from(["[{}]", "[{}]\n", "[{}] see [1]"]),
)
def test_pythonic_decodes_what_mlx_lms_parser_decodes_on_well_formed_markup(prose, calls, form):
    from app.protocol.family_parsers import pythonic

    text = prose + form.format(", ".join(calls))
    assert _outcome(pythonic, text) == _outcome(_mlx_lm("pythonic"), text) is not None


_PYTHONIC_PIECES = [
    *("[", "]", "(", ")", ")]", "[run(", "run", "a.b", ".", "é", "\u0301", "²", "=", ",", ", "),
    *("a=", '"', "'", '"x"', "1", " ", "\n", "True", "null", "x y", "[1]", "{", "}", "a=1"),
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PYTHONIC_PIECES), max_size=16).map("".join))
def test_pythonic_decodes_any_text_as_mlx_lms_parser_does(text):
    from app.protocol.family_parsers import pythonic

    assert _outcome(pythonic, text) == _outcome(_mlx_lm("pythonic"), text)


_MINIMAX = ("<minimax:tool_call>", "</minimax:tool_call>")
_MINIMAX_CALL = '<invoke name="run"><parameter name="command">ls</parameter></invoke>'


@pytest.mark.parametrize(
    ("opening", "loop", "closing", "n"),
    [
        ("", "<invoke name=", "", 8000),  # invokes never closed
        ('<invoke name="run">', "<parameter name=", "</invoke>", 8000),  # parameters
    ],
)
def test_minimax_m2_markup_a_model_loops_on_is_read_in_linear_time(opening, loop, closing, n):
    """mlx-lm's regexes read to the end from every opening never closed: 64 KB
    of ``<invoke name=`` held the event loop 0.1 s, growing with its square."""
    decoder = ToolCallDecoder(TOOLS, "minimax_m2", _MINIMAX)

    def decode(size: int) -> list[ToolCall] | None:
        looping = opening + loop * (size // len(loop)) + closing
        return decoder.decode(decoder.markups[0], _MINIMAX_CALL + looping)

    assert _growth(decode, n) < 8
    calls = [ToolCall("run", '{"command": "ls"}')] + [ToolCall("run", "{}")] * bool(closing)
    assert decode(n) == calls  # as mlx-lm: a call closed around a loop has no arguments


def _minimax_name(quoted: str) -> st.SearchStrategy[str]:
    return st.sampled_from(["run", "command", "limit", "env", "a b", "é"]).map(
        lambda name: quoted.format(name)
    )


_MINIMAX_QUOTE = st.sampled_from(['"{}"', "'{}'", "{}", ' "{}" '])
_MINIMAX_VALUE = st.text(st.sampled_from('ab 1{}[]"<>\n'), max_size=8).filter(
    lambda v: "</parameter>" not in v and "</invoke>" not in v and "<parameter name=" not in v
)
_MINIMAX_PARAMETER = st.tuples(_MINIMAX_QUOTE.flatmap(_minimax_name), _MINIMAX_VALUE).map(
    lambda p: f"<parameter name={p[0]}>{p[1]}</parameter>"
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            _MINIMAX_QUOTE.flatmap(_minimax_name),
            st.lists(_MINIMAX_PARAMETER, max_size=3),
            st.sampled_from(["", "\n"]),
        ),
        min_size=1,
        max_size=3,
    ),
    st.sampled_from(["", "\n", " "]),
)
def test_minimax_m2_decodes_what_mlx_lms_parser_decodes_on_well_formed_markup(calls, gap):
    from app.protocol.family_parsers import minimax_m2

    text = gap.join(
        f"<invoke name={name}>{space}" + space.join(ps) + f"{space}</invoke>"
        for name, ps, space in calls
    )
    ours = _outcome(lambda t: minimax_m2(t, TOOLS), text)
    assert ours == _outcome(lambda t: _mlx_lm("minimax_m2")(t, TOOLS), text) is not None


_MINIMAX_PIECES = [
    *("<invoke name=", "</invoke>", "<parameter name=", "</parameter>", '"run">', "run>", ">"),
    *('"command">', "limit>", "1", "ls", "null", "[1]", " ", "\n", '"', "'", "<", "é", "x"),
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_MINIMAX_PIECES), max_size=14).map("".join))
def test_minimax_m2_decodes_any_text_as_mlx_lms_parser_does(text):
    from app.protocol.family_parsers import minimax_m2

    ours = _outcome(lambda t: minimax_m2(t, TOOLS), text)
    assert ours == _outcome(lambda t: _mlx_lm("minimax_m2")(t, TOOLS), text)


_KIMI_K2 = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
_KIMI_K2_CALL = (
    '<|tool_call_begin|>functions.run:0<|tool_call_argument_begin|>{"command": "ls"}'
    "<|tool_call_end|>"
)


@pytest.mark.parametrize("loop", ["<|tool_call_begin|>", "<|tool_call_begin|>functions.run:1"])
def test_kimi_k2_markup_a_model_loops_on_is_read_in_linear_time(loop):
    """mlx-lm's regex read to the end from every ``<|tool_call_begin|>`` never
    closed: 64 KB of them held the event loop 0.05 s, growing with its square."""
    decoder = ToolCallDecoder(TOOLS, "kimi_k2", _KIMI_K2)

    def decode(size: int) -> list[ToolCall] | None:
        return decoder.decode(decoder.markups[0], _KIMI_K2_CALL + loop * (size // len(loop)))

    assert _growth(decode, 16000) < 8
    assert decode(16000) == [ToolCall("run", '{"command": "ls"}', "functions.run:0")]


_K2_HEAD = st.tuples(
    st.sampled_from(["", " ", "\n"]),
    st.sampled_from(["functions.", ""]),
    st.sampled_from(["run", "a.b", "x:y", "é"]),
    st.sampled_from(["0", "12"]),
    st.sampled_from(["", " ", "\n"]),
).map(lambda h: "{}{}{}:{}{}".format(*h))
_K2_ARGUMENTS = st.sampled_from(['{"command": "ls"}', "{}", " {'a': 1} ", "[1]", "x", ""])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(_K2_HEAD, _K2_ARGUMENTS), min_size=1, max_size=3),
    st.sampled_from(["", "\n", " "]),
    st.booleans(),
)
def test_kimi_k2_decodes_what_mlx_lms_parser_decodes_on_well_formed_markup(calls, gap, wrapped):
    from app.protocol.family_parsers import kimi_k2

    text = gap.join(
        f"<|tool_call_begin|>{head}<|tool_call_argument_begin|>{args}<|tool_call_end|>"
        for head, args in calls
    )
    if not wrapped:  # one call with no begin and end tags: the whole text is read
        text = f"{calls[0][0]}<|tool_call_argument_begin|>{calls[0][1]}"
    assert _outcome(kimi_k2, text) == _outcome(_mlx_lm("kimi_k2"), text) is not None


_K2_PIECES = [
    *("<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>", "functions."),
    *("run", ":", "0", "12", " ", "\n", "{}", '{"a": 1}', "x", "é", "<|", "|>", "."),
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_K2_PIECES), max_size=14).map("".join))
def test_kimi_k2_decodes_any_text_as_mlx_lms_parser_does(text):
    from app.protocol.family_parsers import kimi_k2

    assert _outcome(kimi_k2, text) == _outcome(_mlx_lm("kimi_k2"), text)
