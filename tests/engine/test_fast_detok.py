"""The table-driven byte-level BPE detokenizer and the SentencePiece one holding
its text in pieces stream exactly what mlx-lm's do, but for a character the
reply ends inside, which they drop (mlx-lm's end in U+FFFD)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    _byte_decoder,
)
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine import fast_detok
from engine.fast_detok import TableBPEDetokenizer, detokenizer_factory
from engine.text_output import TextOutput, _keep_leading_space
from engine.utf8_tail import complete_text
from tests.helpers.tiny_models import write_spm_tokenizer


def cut(streamed: tuple[list[str], str], data: bytes) -> tuple[list[str], str]:
    """mlx-lm's segments and text, less the U+FFFD its finalize decodes a
    character the reply ends inside to (kvwarm drops it: complete_text)."""
    segments, text = streamed
    if complete_text(data) == data.decode("utf-8", "replace"):
        return segments, text
    assert segments[-1].endswith("\ufffd")
    return [*segments[:-1], segments[-1][:-1]], text[:-1]


def bpe_bytes(detok, tokens: list[int]) -> bytes:
    return b"".join(detok._table[t] if t < len(detok._table) else b"!" for t in tokens)


def spm_bytes(detok, tokens: list[int]) -> bytes:
    return b"".join(detok.tokenmap[t] for t in tokens)


def stream(detok, tokens, push=False):
    segments = []
    for t in tokens:
        if push:  # the one-call form TextOutput uses
            segments.append(detok.push(t))
            continue
        detok.add_token(t)
        segments.append(detok.last_segment)
    detok.finalize()
    segments.append(detok.last_segment)
    return segments, detok.text


@pytest.fixture(scope="module")
def make(byte_tokenizer):
    assert type(byte_tokenizer.detokenizer) is BPEStreamingDetokenizer
    return detokenizer_factory(byte_tokenizer)


words = st.text(alphabet=st.sampled_from(list(" \n\tabcxyz.é€😀")), max_size=30)
ids = st.lists(st.integers(0, 262), max_size=40)  # specials and past-vocab ids included


@settings(max_examples=300, deadline=None)
@given(data=st.one_of(words, ids), trim=st.booleans(), push=st.booleans())
def test_same_segments_and_text_as_mlx_lm(byte_tokenizer, make, data, trim, push):
    # text as the model would write it (spaces, multi-byte characters), or any ids
    tokens = (
        byte_tokenizer.encode(data, add_special_tokens=False) if isinstance(data, str) else data
    )
    theirs, ours = byte_tokenizer.detokenizer, make()
    assert isinstance(ours, TableBPEDetokenizer)
    if not trim:
        _keep_leading_space(theirs)
        _keep_leading_space(ours)
    assert stream(ours, tokens, push) == cut(stream(theirs, tokens), bpe_bytes(ours, tokens))


def test_fresh_detokenizers_share_nothing_but_the_table(make):
    a, b = make(), make()
    a.add_token(ord("h"))
    assert b.text == "" and b.tokens == []
    assert a._table is b._table


def test_other_tokenizer_kinds_keep_mlx_lms_detokenizer():
    class Wrapper:
        @property
        def detokenizer(self):
            return "theirs"

    assert detokenizer_factory(Wrapper())() == "theirs"


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm")
    write_spm_tokenizer(path)
    wrapper = load_tokenizer(path)
    assert type(wrapper.detokenizer) is SPMStreamingDetokenizer
    return wrapper


@settings(max_examples=300, deadline=None)
@given(data=st.data(), trim=st.booleans(), push=st.booleans())
def test_sentencepiece_streams_the_segments_and_text_mlx_lms_does(spm, data, trim, push):
    # any ids: words with and without their space, byte tokens (split characters)
    tokens = data.draw(st.lists(st.integers(0, len(spm) - 1), max_size=40))
    theirs, ours = spm.detokenizer, detokenizer_factory(spm)()
    if not trim:
        _keep_leading_space(theirs)
        _keep_leading_space(ours)
    assert stream(ours, tokens, push) == cut(stream(theirs, tokens), spm_bytes(ours, tokens))


def test_a_sentencepiece_reply_is_held_in_pieces_not_copied_per_token(spm):
    """mlx-lm's ``self.text += text`` copied the whole reply on every token."""
    words = [spm.convert_tokens_to_ids(w) for w in ("\u2581hello", "\u2581world")]
    detok = detokenizer_factory(spm)()
    out = TextOutput(detok, ("STOP",))
    streamed = "".join(out.add_token(words[i % 2]) for i in range(2000)) + out.finish()
    assert len(detok._out._parts) == 2000  # noqa: SLF001 - one per token, never joined
    assert detok.text == streamed == "hello" + " world hello" * 999 + " world"
    b = detokenizer_factory(spm)()
    assert b.text == "" and b.tokens == [] and b.tokenmap is detok.tokenmap


def _byte_id(wrapper, byte: int) -> int:
    """The byte tokenizer's id for one raw byte (its byte-level character)."""
    char = next(c for c, b in _byte_decoder().items() if b == byte)
    return wrapper.convert_tokens_to_ids(char)


def _held_runs(byte_tokenizer, spm) -> dict[str, tuple[Any, list[int]]]:
    """Runs a detokenizer held whole while its text ended in U+FFFD (or, for
    byte-level BPE, in a lone space): a maker and the run's repeating ids."""
    bpe = detokenizer_factory(byte_tokenizer)
    return {
        "bpe real U+FFFD": (bpe, byte_tokenizer.encode("\ufffd", add_special_tokens=False)),
        "bpe 0xFF bytes": (bpe, [_byte_id(byte_tokenizer, 0xFF)]),
        "bpe lone spaces": (bpe, [_byte_id(byte_tokenizer, 0x20)]),
        "spm real U+FFFD": (detokenizer_factory(spm), [3 + 0xEF, 3 + 0xBF, 3 + 0xBD]),
        "spm 0xFF bytes": (detokenizer_factory(spm), [3 + 0xFF]),
    }


RUNS = ["bpe real U+FFFD", "bpe 0xFF bytes", "bpe lone spaces", "spm real U+FFFD", "spm 0xFF bytes"]
# a lone-space run decodes ASCII: its quadratic cost too small to time reliably
SLOW_RUNS = [r for r in RUNS if r != "bpe lone spaces"]


@pytest.mark.parametrize("run", SLOW_RUNS)
def test_a_held_run_costs_each_token_the_same_however_long(byte_tokenizer, spm, run):
    """The held run's bytes were joined and decoded again for every token:
    quadratic (5k -> 20k 0xFF tokens took 16x as long), the engine thread stalled."""
    make, unit = _held_runs(byte_tokenizer, spm)[run]
    a = byte_tokenizer.encode("a", add_special_tokens=False)[0]
    if run.startswith("spm"):
        a = spm.convert_tokens_to_ids("\u2581hello")

    def seconds(n: int) -> float:
        best = float("inf")
        for _ in range(3):  # the least of three: a noisy machine only adds time
            detok, ids = make(), [a, *unit * (n // len(unit)), a]
            start = time.perf_counter()
            for t in ids:
                detok.push(t)  # as TextOutput does: each segment taken
            detok.finalize()
            best = min(best, time.perf_counter() - start)
        return best

    n = 8000
    assert seconds(4 * n) < 8 * seconds(n)  # linear: ~4x; quadratic: ~16x


@pytest.mark.parametrize("run", RUNS)
def test_a_long_held_run_streams_before_it_ends(byte_tokenizer, spm, run):
    """Nothing streamed until a run of U+FFFDs (a model echoing mojibake) ended;
    the text as a whole stays what it was."""
    make, unit = _held_runs(byte_tokenizer, spm)[run]
    ids = unit * (2000 // len(unit))
    detok = make()
    streamed = "".join(detok.push(t) for t in ids)
    detok.finalize()
    final = streamed + detok.last_segment
    assert len(streamed) >= len(final) - 300  # all but a bounded tail, while streaming
    old = {"bpe": BPEStreamingDetokenizer, "spm": SPMStreamingDetokenizer}[run[:3]]
    theirs = (byte_tokenizer if run.startswith("bpe") else spm).detokenizer
    assert type(theirs) is old
    for t in ids:
        theirs.add_token(t)
    theirs.finalize()
    assert final == detok.text == theirs.text  # mlx-lm's text, character for character


@settings(max_examples=300, deadline=None)
@given(data=st.one_of(words, ids), trim=st.booleans())
def test_a_run_streamed_past_hold_ends_in_mlx_lms_text(byte_tokenizer, make, data, trim):
    """With runs streaming after one held token, any ids (invalid bytes, split
    characters, lone spaces, tokens mlx-lm's finalize maps otherwise) still give
    mlx-lm's text."""
    tokens = (
        byte_tokenizer.encode(data, add_special_tokens=False) if isinstance(data, str) else data
    )
    theirs = byte_tokenizer.detokenizer
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_detok, "HOLD", 1)
        ours = make()
        if not trim:
            _keep_leading_space(theirs)
            _keep_leading_space(ours)
        expected = cut(stream(theirs, tokens), bpe_bytes(ours, tokens))
        assert stream(ours, tokens, True)[1] == expected[1]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), trim=st.booleans())
def test_a_sentencepiece_run_streamed_past_hold_ends_in_mlx_lms_text(spm, data, trim):
    tokens = data.draw(st.lists(st.integers(0, len(spm) - 1), max_size=40))
    theirs = spm.detokenizer
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_detok, "HOLD", 1)
        ours = detokenizer_factory(spm)()
        if not trim:
            _keep_leading_space(theirs)
            _keep_leading_space(ours)
        expected = cut(stream(theirs, tokens), spm_bytes(ours, tokens))
        assert stream(ours, tokens, True)[1] == expected[1]


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (_utf8("Done ") + [0xE6, 0x97], "Done "),  # cut by max_tokens mid-character
        (_utf8("Done ") + [0xF0, 0x9F, 0x98], "Done "),
        (_utf8("Done ") + [0xFF], "Done \ufffd"),  # an invalid byte is no character begun
        (_utf8("a") + [0xFF, 0xE6], "a\ufffd"),  # invalid, then a character begun
        (_utf8("a") + [0xED, 0xA0], "a\ufffd\ufffd"),  # a surrogate's start: never completes
        (_utf8("a") + [0xE6, 0x41], "a\ufffdA"),  # not at the end: replaced, as before
    ],
)
@pytest.mark.parametrize("kind", ["bpe", "bpe streamed", "spm", "spm streamed"])
def test_a_character_cut_at_the_end_is_dropped_not_replaced(
    byte_tokenizer, spm, kind, data, expected
):
    """A reply max_tokens cut inside a character ended in U+FFFD ("Done \\ufffd")."""
    if kind.startswith("bpe"):
        tokens, make = (
            [_byte_id(byte_tokenizer, b) for b in data],
            detokenizer_factory(byte_tokenizer),
        )
    else:
        tokens, make = [3 + b for b in data], detokenizer_factory(spm)
    with pytest.MonkeyPatch.context() as patch:
        if kind.endswith("streamed"):
            patch.setattr(fast_detok, "HOLD", 1)
        assert stream(make(), tokens, push=True)[1] == expected
