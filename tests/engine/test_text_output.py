"""Token -> text streaming on a byte-level tokenizer: every UTF-8 byte is its
own token, so multi-byte characters really do arrive in pieces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.text_output import TextOutput

# NUL is excluded: mlx-lm's BPEStreamingDetokenizer decodes byte 0 as "Ā" (its
# byte map lookup treats 0 as missing), an upstream quirk no model emits in practice.
# U+FFFD too: a real one is text the "never a replacement character" checks cannot
# tell from a split character (hypothesis drew one and failed CI at random).
TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\x00\ufffd"),
    max_size=60,
)


def _stream(tokenizer, text: str, stops: tuple[str, ...] = ()) -> list[str]:
    out = TextOutput(tokenizer.detokenizer, stops)
    chunks = []
    for tok in tokenizer.encode(text, add_special_tokens=False):
        chunks.append(out.add_token(tok))
        if out.stopped:
            break
    chunks.append(out.finish())
    return chunks


def test_multibyte_characters_are_never_split(byte_tokenizer):
    text = "héllo 世界 🙂 ok"
    chunks = _stream(byte_tokenizer, text)
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    # the emoji's four bytes were four tokens but arrive as one piece
    assert any("🙂" in c for c in chunks)


@settings(max_examples=60, deadline=None)
@given(text=TEXT)
def test_stream_reassembles_any_text_without_replacement_chars(byte_tokenizer, text):
    chunks = _stream(byte_tokenizer, text.lstrip(" "))
    assert "".join(chunks) == text.lstrip(" ")
    assert all("\ufffd" not in c for c in chunks)


@settings(max_examples=60, deadline=None)
@given(text=TEXT, stop=st.text(min_size=1, max_size=4))
def test_stop_string_cuts_output_exactly(byte_tokenizer, text, stop):
    text = text.lstrip(" ")
    chunks = _stream(byte_tokenizer, text, (stop,))
    expected = text[: text.find(stop)] if stop in text else text
    assert "".join(chunks) == expected


def test_a_completion_keeps_the_space_before_its_first_word(byte_tokenizer):
    tokens = byte_tokenizer.encode(" Paris.", add_special_tokens=False)

    def text(trim: bool) -> str:
        out = TextOutput(byte_tokenizer.detokenizer, (), trim_leading_space=trim)
        return "".join(out.add_token(t) for t in tokens) + out.finish()

    assert text(trim=True) == "Paris."  # a chat reply starts at its first word
    assert text(trim=False) == " Paris."  # "The capital of France is" + " Paris."


def test_a_stop_string_in_the_reasoning_does_not_end_the_reply(byte_tokenizer):
    """A thinking model restating the question ("Question:") while it thinks: the
    stop matches in the answer after the block only; raw text matches everywhere."""
    from scheduler.request import ReasoningTags

    text = "Question: 2+2?</think>\n\nQuestion: 4. Question: next"
    tokens = byte_tokenizer.encode(text, add_special_tokens=False)

    def reply(reasoning: ReasoningTags | None) -> tuple[str, bool]:
        out = TextOutput(byte_tokenizer.detokenizer, ("Question:",), reasoning=reasoning)
        chunks = []
        for tok in tokens:
            chunks.append(out.add_token(tok))
            if out.stopped:
                return "".join(chunks), True
        return "".join(chunks) + out.finish(), out.stopped

    opened = ReasoningTags("<think>", "</think>", opened=True)
    assert reply(opened) == ("Question: 2+2?</think>\n\n", True)
    assert reply(None) == ("", True)
