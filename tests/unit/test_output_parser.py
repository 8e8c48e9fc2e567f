"""The streaming classifier: chunking invariance, no leaked tags, survivable markup."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.chat_pipeline import ChatCall, _output_side
from app.protocol.output_parser import Content, OutputParser, Reasoning, Syntax, merge
from app.protocol.tool_formats import MARKED, ToolCall, ToolCallDecoder
from kvcache.prompt_key import PromptKey, RenderedPrompt
from scheduler.contracts import TextSyntax

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
TAGS = ["<think>", "</think>", *(m.start for m in MARKED), *(m.end for m in MARKED if m.end)]
LONGEST_TAG = max(len(t) for t in TAGS)

FRAGMENTS = st.sampled_from(
    TAGS
    + [
        "<function=get_weather>",
        "<parameter=city>",
        "</parameter>",
        "</function>",
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        "{",
        "}",
        "<",
        "</",
        "<th",
        "</thi",
        "<tool",
        "[TOOL",
        "<|",
        " ",
        "\n",
        "é",
        "😀",
        "call:get_weather{city:2}",
        "hello",
        '"',
        "\\",
        "<arg_value>",
        '<|"|>',
    ]
)
TEXTS = st.lists(st.one_of(FRAGMENTS, st.text(max_size=5)), max_size=25).map("".join)


def _parser(with_tools: bool, in_reasoning: bool, max_calls: int | None = None) -> OutputParser:
    tools = ToolCallDecoder(TOOLS, "qwen3_coder") if with_tools else None
    return OutputParser(Syntax(starts_in_reasoning=in_reasoning), tools, max_calls)


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def _text_of(events, kind) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


@settings(max_examples=400, deadline=None)
@given(
    TEXTS,
    st.lists(st.integers(0, 200), max_size=30),
    st.booleans(),
    st.booleans(),
    st.sampled_from([None, 1]),
)
def test_any_chunking_gives_the_whole_text_result(text, cuts, with_tools, in_reasoning, calls):
    whole = _parser(with_tools, in_reasoning, calls).parse(text)
    if calls is not None:  # parallel calls off: the same, less every call after the first
        full = _parser(with_tools, in_reasoning).parse(text)
        first = next((i for i, e in enumerate(full) if isinstance(e, ToolCall)), len(full))
        later = {i for i, e in enumerate(full) if isinstance(e, ToolCall) and i > first}
        assert whole == merge([e for i, e in enumerate(full) if i not in later])
    parser = _parser(with_tools, in_reasoning, calls)
    streamed = []
    for piece in _chunks(text, cuts):
        streamed += parser.feed(piece)
        if parser._tool is None:  # noqa: SLF001 - outside a withheld call only a tag's worth waits
            assert parser.held <= LONGEST_TAG or not parser._buf.strip()  # noqa: SLF001
    streamed += parser.finish()
    assert merge(streamed) == whole


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(MARKED),
    st.sampled_from(["", "get_weather", '{"name": "get_weather", "arguments": {}}']),
    st.lists(st.integers(1, 4), min_size=1, max_size=40),
)
def test_an_end_tag_fed_in_small_pieces_closes_a_short_call(markup, inner, sizes):
    """Tiny feeds right after the opening: the end tag can begin in text fed
    before the tail that is searched again is as long as the tag."""
    text = markup.start + inner + markup.end + " done"
    whole = _parser(True, False).parse(text)
    parser, pieces, at = _parser(True, False), [], 0
    for size in sizes * (len(text) // sum(sizes) + 1):
        pieces.append(text[at : at + size])
        at += size
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    assert merge(events) == whole


@pytest.mark.parametrize(
    "call",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "end a call with '
        '</tool_call> then"}}\n</tool_call>',
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nend a call with </tool_call> "
        "then\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>end a call with "
        "</tool_call> then</arg_value>\n</tool_call>",
        '<|tool_call>call:get_weather{city:<|"|>end a call with <tool_call|> then<|"|>}<tool_call|>',
    ],
)
def test_a_closing_tag_inside_an_argument_is_its_text_not_the_calls_end(call):
    """An agent writing a file that mentions the tag: the call was cut at it, did
    not parse, and went out as plain text (the write was lost)."""
    text = call + " done"
    whole = _parser(True, False).parse(text)
    city = (
        "end a call with </tool_call> then"
        if "<|" not in call
        else "end a call with <tool_call|> then"
    )
    assert [(e.name, e.arguments_dict()) for e in whole if isinstance(e, ToolCall)] == [
        ("get_weather", {"city": city})
    ]
    assert _text_of(whole, Content) == "done"
    parser = _parser(True, False)
    streamed = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    assert merge(streamed) == whole


def test_a_call_whose_string_never_closes_still_ends_at_its_tag():
    """Read as inside a value to the end, the end tag it skipped was the call's
    end after all: the broken call is text again and the next call is a call."""
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo}}</tool_call>'
    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    whole = _parser(True, False).parse(broken + " and " + good)
    assert whole == [Content(broken + " and "), ToolCall("get_weather", '{"city": "Rome"}')]


@pytest.mark.parametrize(
    "between, good_value",
    [("\n", '"D:\\\\a \\"b\\""'), (' then the 27" one: ', '"Rome"')],
    ids=["escaped-quotes-after", "a-lone-quote-after"],
)
def test_a_broken_call_does_not_take_the_valid_call_after_it_down(between, good_value):
    """A string left open ("C:\\") read its end tag as text; a later quote closed
    it, and the first call was cut at the second's end tag: neither decoded."""
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": "C:\\"}}</tool_call>'
    good = (
        f'<tool_call>{{"name": "get_weather", "arguments": {{"city": {good_value}}}}}</tool_call>'
    )
    whole = _parser(True, False).parse(broken + between + good)
    assert whole[0] == Content(broken + between)
    assert [e.arguments_dict()["city"] for e in whole if isinstance(e, ToolCall)] == [
        json.loads(good_value)
    ]
    parser = _parser(True, False)
    streamed = [e for ch in broken + between + good for e in parser.feed(ch)] + parser.finish()
    assert merge(streamed) == whole


def test_a_qwen_call_without_its_parameter_end_tag_is_decided_at_its_end_tag():
    """Models leave out </parameter>: the value ends with its function, so the
    call's end tag still ends it there; it is not withheld to the end of the reply."""
    parser = _parser(True, False)
    markup = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</function>\n</tool_call>"
    )
    events = parser.feed(markup + " and")
    assert events and parser._tool is None  # noqa: SLF001
    assert merge(events + parser.finish()) == _parser(True, False).parse(markup + " and")


def test_one_long_text_is_read_in_bounded_pieces(monkeypatch):
    """A reply of thousands of calls read at once was sliced once per call, each
    slice as long as the rest of the reply (quadratic: 384 KB took 3 s)."""
    parser = _parser(True, False)
    longest = [0]
    drain = parser._drain  # noqa: SLF001

    def watched(final: bool) -> None:
        longest[0] = max(longest[0], len(parser._buf))  # noqa: SLF001
        drain(final)

    monkeypatch.setattr(parser, "_drain", watched)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    events = parser.parse(call * 2000)
    assert len([e for e in events if isinstance(e, ToolCall)]) == 2000
    assert longest[0] <= 2 * len(call) + 1024


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet=st.characters(blacklist_characters="<"), max_size=30),
    st.text(alphabet=st.characters(blacklist_characters="<"), max_size=30),
    st.lists(st.integers(0, 80), max_size=20),
)
def test_think_tags_never_leak_into_either_channel(reasoning, answer, cuts):
    text = f"<think>{reasoning}</think>{answer}"
    parser = OutputParser(Syntax())
    events = []
    for piece in _chunks(text, cuts):
        events += parser.feed(piece)
    events += parser.finish()
    assert _text_of(events, Reasoning) == reasoning
    assert _text_of(events, Content) == answer.lstrip()
    for event in events:
        assert "<" not in event.text


HOSTILE = st.lists(
    st.one_of(st.text(max_size=4), st.sampled_from(["<", ">", "</tool_call>", '"', "\\", "]]>"])),
    max_size=10,
).map("".join)


def _formats(value: str) -> list[str]:
    jv = json.dumps(value, ensure_ascii=False)
    return [
        f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{value}\n</parameter>\n</function>\n</tool_call>",
        f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{value}</arg_value>\n</tool_call>",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": {jv}}}}}\n</tool_call>',
        f'<function name="get_weather"><param name="city"><![CDATA[{value}]]></param></function>',
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": {jv}}}}}]',
        f'<|tool_call>call:get_weather{{city:<|"|>{value}<|"|>}}<tool_call|>',
        f'{{"name": "get_weather", "parameters": {{"city": {jv}}}}}',
    ]


@settings(max_examples=150, deadline=None)
@given(HOSTILE, st.lists(st.integers(0, 200), max_size=10))
def test_hostile_values_parse_or_fall_back_never_raise(value, cuts):
    for text in _formats(value):
        whole = OutputParser(Syntax(), ToolCallDecoder(TOOLS, None)).parse(text)
        calls = [e for e in whole if isinstance(e, ToolCall)]
        if not calls:  # fell back: the model's text is delivered as it was written
            assert _text_of(whole, Content) + _text_of(whole, Reasoning) == text.lstrip()
        for call in calls:
            assert call.name == "get_weather"
            assert isinstance(call.arguments_dict(), dict)
        parser = OutputParser(Syntax(), ToolCallDecoder(TOOLS, None))
        streamed = [e for p in _chunks(text, cuts) for e in parser.feed(p)] + parser.finish()
        assert merge(streamed) == whole


@settings(max_examples=100, deadline=None)
@given(
    st.text(
        alphabet=st.characters(blacklist_characters="<>&\r", blacklist_categories=["Cs"]),
        min_size=1,
        max_size=30,
    ).filter(lambda s: s.strip() == s and s.lower() != "null")
)
def test_json_safe_string_values_come_back_exactly(value):
    for text in _formats(value):
        events = OutputParser(Syntax(), ToolCallDecoder(TOOLS, None)).parse(text)
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert len(calls) == 1, text
        assert calls[0].arguments_dict() == {"city": value}, text


def test_held_text_stays_bounded_on_long_streams():
    parser = OutputParser(Syntax(), ToolCallDecoder(TOOLS, None))
    for _ in range(5000):
        parser.feed("a<")
        assert parser.held <= LONGEST_TAG
    parser.feed("<tool_call>")
    for _ in range(5000):  # a long withheld argument is kept in pieces, scanned once
        parser.feed("x</tool_cal")
        assert len(parser._tail) < len("</tool_call>")  # noqa: SLF001
    assert len(parser._tool_parts) == 5001  # noqa: SLF001 - never joined per token
    # an end tag split across pieces still closes the call, cut at the right place
    assert parser.feed("l>") + parser.finish() == [
        Content("<tool_call>" + "x</tool_cal" * 4999 + "x</tool_call>")
    ]


def test_text_around_calls_streams_and_whitespace_between_calls_is_dropped():
    text = (
        "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call>"
    )
    parser = OutputParser(Syntax(), ToolCallDecoder(TOOLS, None))
    first = parser.feed(text[:16])
    assert first == [Content("I will look.\n")]
    rest = parser.feed(text[16:]) + parser.finish()
    assert rest == [
        ToolCall("get_weather", '{"city": "Oslo"}'),
        ToolCall("get_weather", '{"days": 2}'),
    ]
    assert parser.kept_text == "I will look.\n\n"


def test_think_opens_only_before_content():
    events = OutputParser(Syntax()).parse("Use <think>tags</think> like this")
    assert events == [Content("Use <think>tags</think> like this")]


def test_prompt_opened_block_and_glm_style_missing_open_tag():
    events = OutputParser(Syntax(starts_in_reasoning=True)).parse("plan\n</think>\n\nAnswer.")
    assert events == [Reasoning("plan\n"), Content("Answer.")]


def test_no_tools_means_markup_is_content():
    text = "<tool_call>{}</tool_call>"
    assert OutputParser(Syntax()).parse(text) == [Content(text)]


def test_unterminated_call_at_the_end_is_decoded_when_complete_enough():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    events = OutputParser(Syntax(), ToolCallDecoder(TOOLS, None)).parse(text)
    assert events == [ToolCall("get_weather", '{"city": "Oslo"}')]


CUT_CALLS = {
    "hermes": ("json_tools", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'),
    "glm": ("glm47", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo"),
    "qwen3_coder": ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOs"),
    "mistral": ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Os'),
    "llama3": ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city"'),
}


def test_a_call_cut_by_max_tokens_is_text_in_every_format():
    """An agent must never run a call whose arguments max_tokens cut off, whatever
    markup the model writes: the open markup goes out as the text it is."""
    for name, (family, text) in CUT_CALLS.items():
        parser = OutputParser(Syntax(None, None), ToolCallDecoder(TOOLS, family))
        events = merge(parser.feed("Checking. " + text) + parser.finish(truncated=True))
        assert events == [Content("Checking. " + text)], name


def test_a_complete_call_before_the_cut_is_still_a_call():
    parser = OutputParser(Syntax(None, None), ToolCallDecoder(TOOLS, "json_tools"))
    done = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    events = merge(parser.feed(done + " and th") + parser.finish(truncated=True))
    assert events == [ToolCall("get_weather", '{"city": "Oslo"}'), Content("and th")]


def _naive_merge(events):
    """The pairwise fold merge replaced (it copied the run's text per delta)."""
    out = []
    for event in events:
        prev = out[-1] if out else None
        if isinstance(event, (Reasoning, Content)) and type(prev) is type(event):
            out[-1] = type(event)(prev.text + event.text)
        else:
            out.append(event)
    return out


_events = st.lists(
    st.one_of(
        st.builds(Content, st.text(max_size=3)),
        st.builds(Reasoning, st.text(max_size=3)),
        st.builds(ToolCall, st.sampled_from(["f", "g"]), st.just("{}")),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(events=_events, split=st.integers(0, 30))
def test_merge_joins_runs_as_the_pairwise_fold_did(events, split):
    assert merge(events) == _naive_merge(events)
    # merging is idempotent, and merging in two reads equals merging once
    assert merge(merge(events[:split]) + events[split:]) == merge(events)


@settings(max_examples=100, deadline=None)
@given(events=_events, reads=st.sets(st.integers(0, 30)))
def test_an_outcome_read_mid_stream_still_merges_everything(events, reads):
    from app.generation import Outcome

    outcome = Outcome()
    for i, event in enumerate(events):
        if i in reads:
            outcome.events  # noqa: B018 - a read merges what came so far
        outcome.add_event(event)
    assert outcome.events == _naive_merge(events)


@pytest.mark.parametrize(
    ("prefill", "expected"),
    [
        ("", [Reasoning(" 42.")]),  # the prompt opened a block: the reply reasons first
        ("</think>\n\nThe answer is", [Content(" 42.")]),  # the prefill closed it
        ("Let me see.\n</think>\n\n", [Content(" 42.")]),
        ("</think>Sure. <think>", [Reasoning(" 42.")]),  # and opened another
    ],
)
def test_a_prefill_that_closes_the_prompts_think_block_is_answered_as_content(prefill, expected):
    """Qwen3-thinking's and DeepSeek-R1's generation prompts end in ``<think>``:
    an Anthropic prefill continuing after ``</think>`` is an answer, not reasoning
    (its text was lost to the thinking block, or dropped with strip_thinking)."""
    tail = "<|im_start|>assistant\n<think>\n"
    from tests.helpers.fake_engine import CharFormatter

    encode = CharFormatter().encode
    info = SimpleNamespace(syntax=TextSyntax(), vision=None, formatter=CharFormatter())
    call = ChatCall(messages=[{"role": "user", "content": "q"}], fields={}, prefill=prefill)
    rendered = RenderedPrompt(PromptKey.build(encode(tail)), tail=tail)
    _, parser, tags = _output_side(call, info, rendered)
    assert parser.parse(" 42.") == expected
    # the engine's stop strings skip the same block (engine.reasoning_gate)
    assert tags is not None and tags.opened == isinstance(expected[0], Reasoning)


def test_whitespace_a_model_loops_on_is_held_in_linear_time():
    """Whitespace held at a block boundary grew one string per delta, copied whole
    each time: 1M characters of blank lines took 28 s on the event loop."""
    import time

    parser = OutputParser(Syntax(), None)
    began = time.perf_counter()
    for _ in range(500_000):
        assert parser.feed("\n\n") == []
    assert parser.held == 1_000_000
    assert merge(parser.finish()) == [Content("\n" * 1_000_000)]
    assert time.perf_counter() - began < 5  # a quarter of a second now


def test_a_stop_string_keeps_a_call_only_when_it_is_the_calls_closing_tag():
    """A stop string inside a call may have cut arguments after it: text, as
    max_tokens; at the call's own closing tag the call is whole."""
    tools = [{"type": "function", "function": {"name": "run", "parameters": {}}}]

    def parsed(text: str, stop: str):
        parser = OutputParser(Syntax(), ToolCallDecoder(tools, "qwen3_coder"))
        return merge(parser.feed(text) + parser.finish(stopped_at=stop))

    whole = "<tool_call>\n<function=run>\n<parameter=command>\nls\n</parameter>\n</function>\n"
    assert parsed(whole, "</tool_call>") == [ToolCall("run", '{"command": "ls"}')]
    assert parsed(whole, "\n</tool_call>") == [ToolCall("run", '{"command": "ls"}')]
    open_arg = "<tool_call>\n<function=run>\n<parameter=command>\nls\n"
    assert parsed(open_arg, "</parameter>") == [Content(open_arg)]
    assert parsed(whole, "<parameter=") == [Content(whole)]


_BARE_QWEN = "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>"
_OSLO = ToolCall("get_weather", '{"city": "Oslo"}')


def _qwen(text: str, family: str | None = "qwen3_coder") -> tuple[list, str]:
    """``text`` parsed whole and fed a character at a time: both must agree."""
    whole = OutputParser(Syntax(), ToolCallDecoder(TOOLS, family))
    events = whole.parse(text)
    streamed = OutputParser(Syntax(), ToolCallDecoder(TOOLS, family))
    assert merge([e for c in text for e in streamed.feed(c)] + streamed.finish()) == events
    assert streamed.kept_text == whole.kept_text
    return events, whole.kept_text


@pytest.mark.parametrize(
    ("text", "expected", "kept"),
    [
        # Qwen3-Coder / Qwen3.5 leave out the opening <tool_call>: the closing is dropped
        (
            f"I'll check.\n{_BARE_QWEN}\n</tool_call>",
            [Content("I'll check.\n"), _OSLO],
            "I'll check.\n\n",
        ),
        (_BARE_QWEN, [_OSLO], ""),
        (
            f"{_BARE_QWEN}\n{_BARE_QWEN}\n</tool_call>\nDone.",
            [_OSLO, _OSLO, Content("Done.")],
            None,
        ),
        # a closing not right after the call is text
        (f"{_BARE_QWEN} then </tool_call>", [_OSLO, Content("then </tool_call>")], None),
        # a function the request does not offer is text, its closing too
        (
            "See <function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>",
            [
                Content(
                    "See <function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>"
                )
            ],
            None,
        ),
        # a value holding </function> is not the call's end
        (
            "<function=get_weather>\n<parameter=city>\na</function>b\n</parameter>\n</function>",
            [ToolCall("get_weather", '{"city": "a</function>b"}')],
            None,
        ),
    ],
)
def test_a_qwen_function_without_its_tool_call_opening_is_a_call(text, expected, kept):
    events, kept_text = _qwen(text)
    assert events == expected
    if kept is not None:
        assert kept_text == kept


def test_a_bare_qwen_function_is_a_call_only_for_the_qwen3_coder_family():
    text = f"I'll check.\n{_BARE_QWEN}\n</tool_call>"
    assert _qwen(text, "glm47")[0] == [Content(text)]


def test_the_start_of_a_bare_qwen_function_is_held_back_while_it_streams():
    parser = OutputParser(Syntax(), ToolCallDecoder(TOOLS, "qwen3_coder"))
    assert parser.feed("I'll check.\n<func") == [Content("I'll check.\n")]
    assert parser.feed("tion=get_weather>\n<parameter=city>\nOslo\n") == []
    assert parser.feed("</parameter>\n</function>\n</tool") == [_OSLO]
    assert parser.feed("_call>") + parser.finish() == []


@pytest.mark.parametrize(
    "text",
    [
        "Call <function=get_weather> and close it with </function>.",
        "Call <function=get_weather>\n<parameter=city>\nOslo\n</parameter>\nthen </function> ends",
        "It ends the reply: <function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n",
    ],
)
def test_prose_quoting_a_bare_qwen_function_stays_text(text):
    """Without its <tool_call> a call is only a function's own markup: its name,
    parameters, its closing; not prose that names it in passing."""
    assert _qwen(text)[0] == [Content(text)]


_WRAPPED_OSLO = f"<tool_call>\n{_BARE_QWEN}\n</tool_call>"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # prose quoting the markup, then the real call: the mention opened a span that
        # ran to the real call's </function>, did not decode, and took the call with it
        (
            f"Use `<function=foo>` to call.\n{_WRAPPED_OSLO}",
            [Content("Use `<function=foo>` to call.\n"), _OSLO],
        ),
        (
            f"I will call <function=get_weather> now.\n{_WRAPPED_OSLO}",
            [Content("I will call <function=get_weather> now.\n"), _OSLO],
        ),
        (
            f"I will call <function=get_weather> now:\n{_BARE_QWEN}\n</tool_call>",
            [Content("I will call <function=get_weather> now:\n"), _OSLO],
        ),
        # the mention's shape breaks where the real function begins
        (
            f"<function=get_weather>\n{_BARE_QWEN}",
            [Content("<function=get_weather>\n"), _OSLO],
        ),
        (
            f"Write <function=get_weather > then the parameters.\n{_WRAPPED_OSLO}",
            [Content("Write <function=get_weather > then the parameters.\n"), _OSLO],
        ),
        # a call's shape that does not decode (days is no integer) gives back only
        # its opening: the call quoted in its value is read again
        (
            f"<function=get_weather>\n<parameter=days>\nx {_WRAPPED_OSLO}",
            [Content("<function=get_weather>\n<parameter=days>\nx "), _OSLO],
        ),
    ],
)
def test_a_mention_of_a_bare_qwen_function_does_not_swallow_the_call_after_it(text, expected):
    assert _qwen(text)[0] == expected


def test_prose_after_a_mention_of_a_bare_qwen_function_streams_at_once():
    """Prose naming <function=f> was withheld, all of it, until the reply ended."""
    parser = OutputParser(Syntax(), ToolCallDecoder(TOOLS, "qwen3_coder"))
    events = parser.feed("Call <function=get_weather> to see it.")
    for n in range(200):
        events += parser.feed(f" word{n}")
    expected = "Call <function=get_weather> to see it." + "".join(f" word{n}" for n in range(200))
    assert merge(events) == [Content(expected)]
    assert parser.finish() == []


_BARE_PIECES = st.sampled_from(
    [
        "<function=",
        "get_weather",
        "get_",
        "foo",
        ">",
        " ",
        "\n",
        "`",
        "word",
        "<",
        "</",
        "<parameter=city>",
        "<parameter=days>",
        "</parameter>",
        "</function>",
        "<tool_call>",
        "</tool_call>",
        _BARE_QWEN,
        '{"name": "get_weather", "arguments": {"city": "',
        '"}}',
        '"',
        "<think>",
        "</think>",
    ]
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(_BARE_PIECES, max_size=30).map("".join),
    st.lists(st.integers(0, 300), max_size=30),
    st.sampled_from([None, frozenset(), frozenset({"get_weather"})]),
    st.booleans(),
)
def test_bare_qwen_functions_read_alike_in_any_chunking(text, cuts, allowed, in_reasoning):
    """Spans given back and read again (mentions of <function=) end alike however
    the text streams: the events, and the text kept besides the calls."""

    def parser() -> OutputParser:
        decoder = ToolCallDecoder(TOOLS, "qwen3_coder", allowed=allowed)
        return OutputParser(Syntax(starts_in_reasoning=in_reasoning), decoder)

    whole = parser()
    events = whole.parse(text)
    streamed = parser()
    pieces = [e for p in _chunks(text, cuts) for e in streamed.feed(p)]
    assert merge(pieces + streamed.finish()) == events
    assert streamed.kept_text == whole.kept_text
    if "think>" not in text and not any(isinstance(e, ToolCall) for e in events):
        # no call: every character given back, none lost (blanks before markup aside)
        assert _text_of(events, Content) + _text_of(events, Reasoning) in (text, text.lstrip())


@pytest.mark.parametrize(
    "text",
    [
        "I use <function=get_weather> here. " * 3000,
        "<function=get_weather>\n<parameter=city>\n" * 3000 + "</parameter>\nthen prose",
        # the first one's days swallows a city parameter: it does not decode
        "<function=get_weather>\n<parameter=days>\n<parameter=city>\n" * 3000
        + "</parameter>\n</function> x",
        "<function=get_weather>\n<parameter=city>\n" * 3000,
        "<function=get_" * 5000,
    ],
    ids=["mentions", "nested-shape-breaks", "nested-does-not-decode", "never-closed", "names"],
)
def test_a_reply_of_thousands_of_bare_mentions_is_read_in_linear_work(text, monkeypatch):
    """Each mention given back is read again from just after its <function=: a
    span read to the end for each of them would be quadratic. Counted, not timed:
    the characters the shape check reads, and all characters read (_fed)."""
    from app.protocol import bare_function

    read = [0]
    feed = bare_function.BareFunction.feed

    def counted(self, piece: str) -> int | None:
        at = feed(self, piece)
        read[0] += len(piece) if at is None else at
        return at

    monkeypatch.setattr(bare_function.BareFunction, "feed", counted)
    for cuts in ([], list(range(0, len(text), 7))):
        read[0] = 0
        parser = OutputParser(Syntax(), ToolCallDecoder(TOOLS, "qwen3_coder"))
        events = [e for p in _chunks(text, cuts) for e in parser.feed(p)] + parser.finish()
        assert merge(events) == [Content(text)]
        assert read[0] <= 2 * len(text) + 2048
        assert parser._fed <= 2 * len(text) + 2048  # noqa: SLF001


def test_a_bare_function_the_turn_does_not_allow_streams_as_prose():
    """allowed_tools leaves get_weather out: its markup is prose, sent as it comes."""
    decoder = ToolCallDecoder(TOOLS, "qwen3_coder", allowed=frozenset())
    parser = OutputParser(Syntax(), decoder)
    start = "<function=get_weather>\n<parameter=city>\nOslo"
    assert merge(parser.feed(start)) == [Content(start)]
    assert merge(parser.feed("\n</parameter>\n</function>") + parser.finish()) == [
        Content("\n</parameter>\n</function>")
    ]
