"""A conversation's message digests decide which earlier rendering a new turn
reuses: equal messages must digest equal however their objects were built
(parsed afresh, shared, interned), and different messages differently."""

from __future__ import annotations

import copy
import json
import sys

from hypothesis import given
from hypothesis import strategies as st

from engine.chat_render import Conversation

scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
)
values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3)
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": values}),
    min_size=1,
    max_size=4,
)


def digests(msgs):
    conversation = Conversation.of(msgs, {"tools": None})
    assert conversation is not None
    return conversation.messages


@given(messages)
def test_equal_messages_digest_equal_however_built(msgs):
    reparsed = json.loads(json.dumps(msgs))  # fresh objects, as the next request brings
    interned = [{sys.intern(k): v for k, v in m.items()} for m in copy.deepcopy(msgs)]
    if reparsed == msgs:  # floats like -0.0 survive JSON; a tuple would not
        assert digests(reparsed) == digests(msgs)
    assert digests(interned) == digests(msgs)


@given(messages, messages)
def test_different_messages_digest_differently(a, b):
    for x, y in zip(a, b):
        same_types = json.dumps(x) == json.dumps(y) and repr(x) == repr(y)
        assert (digests([x]) == digests([y])) == same_types


def test_a_shared_string_object_digests_as_two_equal_ones():
    text = "line " * 3
    shared = {"role": "user", "content": [text, text]}
    separate = {"role": "user", "content": [text, "".join(["line "] * 3)]}
    assert digests([shared]) == digests([separate])


def test_values_without_a_marshal_form_still_digest():
    class Tag(dict):
        pass

    assert digests([{"role": "user", "content": Tag(a=1)}]) == digests(
        [{"role": "user", "content": Tag(a=1)}]
    )
    assert digests([{"role": "user", "content": Tag(a=1)}]) != digests(
        [{"role": "user", "content": Tag(a=2)}]
    )
