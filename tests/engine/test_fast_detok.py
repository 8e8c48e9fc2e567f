"""The table-driven byte-level BPE detokenizer streams exactly what mlx-lm's does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from engine.fast_detok import TableBPEDetokenizer, detokenizer_factory
from engine.text_output import _keep_leading_space


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
