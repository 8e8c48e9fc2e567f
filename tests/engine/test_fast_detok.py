"""The table-driven byte-level BPE detokenizer and the SentencePiece one holding
its text in pieces stream exactly what mlx-lm's do."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.fast_detok import TableBPEDetokenizer, detokenizer_factory
from engine.text_output import TextOutput, _keep_leading_space
from tests.helpers.tiny_models import write_spm_tokenizer


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
    assert stream(ours, tokens, push) == stream(theirs, tokens)


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
    assert stream(ours, tokens, push) == stream(theirs, tokens)


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
