"""The windowed detokenizer (tokenizers mlx-lm decodes a whole line per token):
the same text as decoding every token at once, streamed without retractions,
each token decoding a bounded window."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.fast_detok import detokenizer_factory
from engine.text_output import TextOutput
from engine.window_detok import MAX_HELD, WINDOW, WindowDetokenizer
from tests.helpers.tiny_models import METASPACE_WORDS, write_metaspace_tokenizer

WORDS = METASPACE_WORDS


class Counting:
    """A tokenizer's decode that remembers the longest run of ids it was given."""

    def __init__(self, hf):
        self.hf = hf
        self.longest = 0

    def decode(self, ids):
        self.longest = max(self.longest, len(ids))
        return self.hf.decode(ids)


def stream(make, tokens: list[int]) -> tuple[list[str], str]:
    out = TextOutput(make(), ())
    deltas = [out.add_token(t) for t in tokens]
    return deltas, "".join(deltas) + out.finish()


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list(" \nab,.é€😀\ufffd日")), max_size=80))
def test_byte_tokens_stream_the_text_decoding_them_all_gives(naive_bytes, text):
    make = detokenizer_factory(naive_bytes)
    assert isinstance(make(), WindowDetokenizer)
    tokens = naive_bytes.encode(text, add_special_tokens=False)
    deltas, whole = stream(make, tokens)
    assert whole == naive_bytes.decode(tokens)
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text  # never a split character


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(1, len(WORDS) + 1), max_size=60))
def test_metaspace_words_stream_the_text_decoding_them_all_gives(metaspace, ids):
    _, whole = stream(detokenizer_factory(metaspace), ids)
    assert whole == metaspace.decode(ids)  # its first word without a space, the rest with


def test_each_token_decodes_a_bounded_window_however_long_the_line(naive_bytes):
    """mlx-lm's naive detokenizer decoded the whole line per token: 5 s of
    engine-thread time for 8k tokens without a newline."""
    text = "ab" * 3000 + "\ufffd" * 1000 + "日本" * 500
    _bounded_pass(naive_bytes, naive_bytes.encode(text, add_special_tokens=False), False)


def _bounded_pass(wrapper, ids: list[int], clean_spaces: bool) -> None:
    """``ids`` through a WindowDetokenizer: all of their text, each token decoding
    a bounded window."""
    counting = Counting(wrapper._tokenizer)
    detok = WindowDetokenizer(counting, clean_spaces)
    for t in ids:
        detok.add_token(t)
    detok.finalize()
    assert detok.text == wrapper._tokenizer.decode(ids)
    assert counting.longest <= WINDOW + MAX_HELD


def test_a_real_replacement_character_is_streamed_not_held_to_the_end(naive_bytes):
    """Text ending in U+FFFD was held as an unfinished character: a run of real
    ones streamed nothing until the reply ended, decoded again per token."""
    tokens = naive_bytes.encode("\ufffd" * 50, add_special_tokens=False)
    deltas, whole = stream(detokenizer_factory(naive_bytes), tokens)
    assert whole == "\ufffd" * 50
    assert len("".join(deltas)) >= 40  # all but the last few tokens' worth, while streaming


def test_a_run_of_spaces_held_for_clean_up_still_restarts_the_window(metaspace):
    """A trailing space held (the tokenizer cleans "a ," into "a,") kept the window
    from restarting: a model looping on spaces decoded the whole run per token."""
    _bounded_pass(metaspace, [2] + [1] * 2000 + [3], True)  # "hello", 2,000 spaces, "world"


CLEAN_WORDS = ["it", "'", "s", "n't", "do", ",", ".", "x", "\u2581\u2581\u2581"]


@pytest.fixture(scope="module")
def metaspace_clean(tmp_path_factory):
    """A Metaspace tokenizer that cleans up spaces ("it ' s" decodes to "it's"),
    with a token of several spaces."""
    path = Path(tmp_path_factory.mktemp("metaspace_clean"))
    write_metaspace_tokenizer(path, CLEAN_WORDS, clean_spaces=True)
    return load_tokenizer(path)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(1, len(CLEAN_WORDS) + 1), max_size=60))
@example(ids=[1, 1, 3, 4])  # "  ' s": " ' " then " 's" take both spaces
@example(ids=[2, 1, 1, 3, 1, 4])
def test_text_the_space_cleanup_rewrites_streams_as_decoding_it_all_gives(metaspace_clean, ids):
    """Only a trailing space was held: " '" streamed, then " ' s" decoded to "'s"
    and the window's offsets lost the "s" ("it ' x" for "it's x")."""
    make = detokenizer_factory(metaspace_clean)
    assert isinstance(make(), WindowDetokenizer)
    _, whole = stream(make, ids)
    assert whole == metaspace_clean.decode(ids)


def test_a_run_of_multi_space_tokens_still_restarts_the_window(metaspace_clean):
    """Only a last token of exactly one space let the window restart: a run of
    several-space tokens decoded the whole run per token (quadratic)."""
    many = CLEAN_WORDS.index("\u2581\u2581\u2581") + 2
    _bounded_pass(metaspace_clean, [2] + [many] * 2000 + [9], True)  # "it", spaces, "x"


@pytest.fixture(scope="module")
def naive_spm(tmp_path_factory):
    """A byte-fallback tokenizer behind the windowed detokenizer."""
    from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, TokenizerWrapper

    from tests.helpers.tiny_models import write_spm_tokenizer

    path = Path(tmp_path_factory.mktemp("naive_spm"))
    write_spm_tokenizer(path)
    return TokenizerWrapper(load_tokenizer(path)._tokenizer, NaiveStreamingDetokenizer)


def _raw(wrapper, kind: str, data: bytes) -> list[int]:
    """Ids of one raw byte each (ByteLevel characters, or <0xNN> tokens)."""
    from mlx_lm.tokenizer_utils import _byte_decoder

    chars = {b: c for c, b in _byte_decoder().items()}
    names = [chars[b] if kind == "bytes" else f"<0x{b:02X}>" for b in data]
    return wrapper.convert_tokens_to_ids(names)


@pytest.mark.parametrize(
    ("data", "cut"),
    [
        (b"\xe6\x97", True),  # max_tokens cut the reply mid-character
        (b"\xf0\x9f\x98", True),
        (b"\xff", False),  # an invalid byte is no character begun: as before
        ("\ufffd".encode(), False),  # a real U+FFFD is text
    ],
)
@pytest.mark.parametrize("kind", ["bytes", "byte fallback"])
def test_a_character_cut_at_the_end_is_dropped_not_replaced(
    naive_bytes, naive_spm, kind, data, cut
):
    """As engine.fast_detok drops it: the reply ended in U+FFFD ("Done \\ufffd")."""
    wrapper = naive_bytes if kind == "bytes" else naive_spm
    make = detokenizer_factory(wrapper)
    assert isinstance(make(), WindowDetokenizer)
    if kind == "bytes":
        before = wrapper.encode("hello 日本", add_special_tokens=False)
    else:  # words: a byte-fallback decode turns a whole run of byte tokens to U+FFFDs
        before = wrapper.convert_tokens_to_ids(["\u2581hello", "\u2581日本"])
    ids = before + _raw(wrapper, kind, data)
    _, whole = stream(make, ids)
    assert whole == wrapper.decode(before if cut else ids)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list(" ab,é€😀\ufffd日")), max_size=40),
    drop=st.integers(0, 3),
)
def test_any_reply_cut_anywhere_ends_before_the_cut_character(naive_bytes, text, drop):
    from engine.utf8_tail import cut_length

    data = text.encode()[: max(0, len(text.encode()) - drop)]
    tokens = naive_bytes.encode(text, add_special_tokens=False)[: len(data)]  # one per byte
    _, whole = stream(detokenizer_factory(naive_bytes), tokens)
    assert whole == naive_bytes.decode(tokens[: len(tokens) - cut_length(data)])


def _untrimmed(make, tokens: list[int]) -> str:
    out = TextOutput(make(), (), trim_leading_space=False)
    return "".join(out.add_token(t) for t in tokens) + out.finish()


def test_a_completion_keeps_the_space_before_its_first_word(metaspace, naive_bytes):
    """A Metaspace decoder drops a sequence's first space: "The capital is" +
    " Paris" came back as "The capital isParis" from /v1/completions."""
    ids = metaspace.convert_tokens_to_ids(["\u2581world", "\u2581!"])
    make = detokenizer_factory(metaspace)
    assert isinstance(make(), WindowDetokenizer)
    assert _untrimmed(make, ids) == " world !"
    assert stream(make, ids)[1] == "world !"  # a chat reply starts at its first word
    ids = naive_bytes.encode(" Paris, 日本", add_special_tokens=False)  # a decoder dropping none
    assert _untrimmed(detokenizer_factory(naive_bytes), ids) == " Paris, 日本"


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(1, len(WORDS) + 1), max_size=60))
def test_untrimmed_metaspace_words_stream_every_space(metaspace, ids):
    """The text of each token, spaces and all (what a decoder dropping nothing gives)."""
    pieces = metaspace.convert_ids_to_tokens(ids)
    assert _untrimmed(detokenizer_factory(metaspace), ids) == "".join(pieces).replace("\u2581", " ")
