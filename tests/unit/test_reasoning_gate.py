"""Stop strings match the answer, not the reasoning before it (engine.reasoning_gate)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.reasoning_gate import ReasoningGate
from engine.stop_matcher import StopMatcher
from scheduler.request import ReasoningTags

TAGS = ReasoningTags("<think>", "</think>", opened=False)
OPENED = ReasoningTags("<think>", "</think>", opened=True)


def run(chunks: list[str], stops: list[str], tags: ReasoningTags | None):
    """The gate then the stop matcher, as engine.text_output chains them."""
    gate = ReasoningGate(tags) if tags is not None else None
    matcher = StopMatcher(stops)
    out = []
    for chunk in chunks:
        passed, matched = gate.feed(chunk) if gate is not None else ("", chunk)
        out.append(passed + matcher.feed(matched))
        if matcher.stopped:
            break
    tail = gate.finish() if gate is not None and not matcher.stopped else ""
    out.append(matcher.feed(tail) + matcher.flush())
    return out, matcher.stopped


def test_a_stop_string_in_an_opened_block_is_reasoning():
    text = "Question: what is 2+2?\n\nSo 4.</think>\n\nAnswer: 4\n\nQuestion: next"
    out, stopped = run([text], ["Question:", "\n\n"], OPENED)
    assert stopped and "".join(out) == "Question: what is 2+2?\n\nSo 4.</think>\n\nAnswer: 4"


def test_a_block_the_model_opens_is_reasoning_too():
    out, stopped = run(
        ["\n<thi", "nk>Question: x</th", "ink>", " Q", "uestion: y"], ["Question:"], TAGS
    )
    assert stopped and "".join(out) == "\n<think>Question: x</think> "


def test_the_blank_lines_after_the_end_tag_are_not_the_answer():
    """The parser drops them: a "\\n\\n" stop would end every thinking reply there."""
    out, stopped = run(["<think>a</think>", "\n\n", "Hi.\n\nMore"], ["\n\n"], TAGS)
    assert stopped and "".join(out) == "<think>a</think>\n\nHi."


def test_a_stop_never_matches_across_the_end_tag():
    out, stopped = run(["x</think>", "Hi"], ["</think>Hi", "k>H"], OPENED)
    assert not stopped and "".join(out) == "x</think>Hi"


def test_text_before_any_tag_is_the_answer():
    out, stopped = run(["\n\nHello"], ["\n\n"], TAGS)
    assert stopped and "".join(out) == ""
    out, stopped = run(["Say <think>Question: x"], ["Question:"], TAGS)
    assert stopped and "".join(out) == "Say <think>"


def test_reasoning_streams_as_it_comes():
    gate = ReasoningGate(OPENED)
    assert gate.feed("plan </thi") == ("plan </thi", "")
    assert gate.feed("nk>Answer") == ("nk>", "Answer")


def test_without_tags_everything_is_matched():
    out, stopped = run(["<think>Question: x"], ["Question:"], None)
    assert stopped and "".join(out) == "<think>"


def _reference(text: str, stops: list[str], tags: ReasoningTags) -> str:
    """Whole-text definition: the reasoning block (opened by the prompt, or at the
    reply's start past whitespace) and the whitespace after its end tag are never
    matched; the rest is cut where the first stop completes."""
    start, end = tags.start, tags.end
    body = text
    if not tags.opened:
        stripped = text.lstrip()
        if not stripped.startswith(start):
            return _cut(text, stops)
        body = stripped[len(start) :]
    i = body.find(end)
    if i < 0:
        return text
    after = body[i + len(end) :]
    answer = after.lstrip()
    return text[: len(text) - len(answer)] + _cut(answer, stops)


def _cut(text: str, stops: list[str]) -> str:
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return text[: min(hits)[1]] if hits else text


@settings(max_examples=400, deadline=None)
@given(
    text=st.lists(st.sampled_from(["<think>", "</think>", "<th", "k>", "</", " ", "\n", "a", "Q"]))
    .map("".join)
    .filter(lambda t: len(t) <= 60),
    stops=st.lists(st.text(alphabet="a Q\n</>k", min_size=1, max_size=4), min_size=1, max_size=3),
    opened=st.booleans(),
    cuts=st.lists(st.integers(0, 60), max_size=12),
)
def test_any_chunking_matches_the_whole_text_and_never_leaks(text, stops, opened, cuts):
    tags = ReasoningTags("<think>", "</think>", opened)
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, _ = run(chunks, stops, tags)
    expected = _reference(text, stops, tags)
    assert "".join(out) == expected
    emitted = ""
    for piece in out:
        emitted += piece
        assert expected.startswith(emitted)  # nothing past the stop ever escapes


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(st.sampled_from(["<think>", "</think>", "<th", "k>", " ", "\n", "a"]))
    .map("".join)
    .filter(lambda t: len(t) <= 60),
    opened=st.booleans(),
    cuts=st.lists(st.integers(0, 60), max_size=12),
)
def test_what_is_matched_is_the_content_the_parser_finds(text, opened, cuts):
    """The gate mirrors app.protocol.output_parser: stops see exactly the answer."""
    from app.protocol.output_parser import Content, OutputParser, Syntax

    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    gate = ReasoningGate(ReasoningTags("<think>", "</think>", opened))
    matched = [gate.feed(text[a:b])[1] for a, b in zip(bounds, bounds[1:])]
    events = OutputParser(Syntax(starts_in_reasoning=opened)).parse(text)
    content = "".join(e.text for e in events if isinstance(e, Content))
    assert "".join(matched) + gate.finish() == content
