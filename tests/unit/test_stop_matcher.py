from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.stop_matcher import StopMatcher


def run(chunks, stops):
    m = StopMatcher(stops)
    out = []
    for c in chunks:
        out.append(m.feed(c))
        if m.stopped:
            break
    out.append(m.flush())
    return out, m.stopped


def test_stop_split_across_chunks_is_never_emitted():
    out, stopped = run(["Hello wo", "r", "ld, and more"], ["world"])
    assert stopped and "".join(out) == "Hello "
    assert all("w" not in piece for piece in out[1:])


def test_partial_prefix_released_when_disproved():
    out, stopped = run(["abc</", "b>rest"], ["</a>"])
    assert not stopped and "".join(out) == "abc</b>rest"
    assert out[0] == "abc"  # "</" held back until disproved


def test_earliest_of_several_stops_wins():
    out, _ = run(["one two three"], ["three", "two"])
    assert "".join(out) == "one "


def test_first_completed_stop_wins_whatever_the_chunking():
    # "<" completes at the second character, before "><<" can
    assert "".join(run(["><", "<"], ["<", "><<"])[0]) == ">"
    assert "".join(run([">", "<", "<"], ["<", "><<"])[0]) == ">"
    assert "".join(run(["><<"], ["<", "><<"])[0]) == ">"


def test_no_stops_passes_through():
    assert run(["a", "b"], [])[0] == ["a", "b", ""]


def _reference(text: str, stops: list[str]) -> str:
    """Whole-text definition: cut at the start of the stop that completes first."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s and s in text]
    return text[: min(hits)[1]] if hits else text


@settings(max_examples=300)
@given(
    text=st.text(alphabet="ab<>/x", max_size=40),
    stops=st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_any_chunking_matches_whole_text_and_never_leaks(text, stops, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, _ = run(chunks, stops)
    expected = _reference(text, stops)
    assert "".join(out) == expected
    emitted = ""
    for piece in out:
        emitted += piece
        assert expected.startswith(emitted)  # nothing past the stop ever escapes
