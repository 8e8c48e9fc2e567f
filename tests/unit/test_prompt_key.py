"""Token spans, cache keys and model-space alignment (the never-a-wrong-hit rule)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.prompt_key import (
    PromptKey,
    TokenSpan,
    align,
    canonicalise,
    chain_hashes,
    token_spans,
)
from kvcache.volatile_rules import RULE_INDEX, CharSpan

TS = RULE_INDEX["timestamp"]  # sentinel rule
SR = RULE_INDEX["system_reminder"]  # droppable rule

# A prompt as segments: ("fixed", tokens) or ("vol", rule, tokens)
fixed = st.lists(st.integers(0, 3), min_size=0, max_size=6).map(lambda t: ("fixed", t))
vol = st.tuples(st.sampled_from([TS, SR]), st.lists(st.integers(0, 3), min_size=1, max_size=3)).map(
    lambda r: ("vol", r[0], r[1])
)
prompts = st.lists(st.one_of(fixed, fixed, vol), min_size=1, max_size=8)


def build(segments) -> PromptKey:
    tokens: list[int] = []
    spans: list[TokenSpan] = []
    for seg in segments:
        if seg[0] == "fixed":
            tokens += seg[1]
        else:
            if spans and spans[-1].end == len(tokens):  # adjacent spans merge in real prompts
                tokens += [9]
            spans.append(TokenSpan(len(tokens), len(tokens) + len(seg[2]), seg[1]))
            tokens += seg[2]
    tokens.append(7)  # a final token (the generation prompt)
    return PromptKey.build(tokens, spans)


def outside_spans(key: PromptKey, end: int) -> list:
    """Tokens before ``end`` with each span replaced by its rule marker (droppable: nothing)."""
    out: list = []
    pos = 0
    for s in key.spans:
        if s.start >= end:
            break
        out += key.model_tokens[pos : s.start]
        if not s.droppable:
            out.append(("span", s.rule))
        pos = s.end
    out += key.model_tokens[pos:end]
    return out


@settings(max_examples=400, deadline=None)
@given(prompts, prompts)
def test_alignment_never_reuses_past_a_real_difference(a_segs, b_segs):
    a, b = build(a_segs), build(b_segs)
    al = align(a, b, skip_volatile=True)
    assert 0 <= al.request_depth <= len(b.model_tokens) - 1
    assert 0 <= al.entry_depth <= len(a.model_tokens)
    # equal outside volatile spans up to the reuse point
    assert outside_spans(a, al.entry_depth) == outside_spans(b, al.request_depth)
    # the cut never falls inside a span
    for key, depth in ((a, al.entry_depth), (b, al.request_depth)):
        assert not any(s.start < depth < s.end for s in key.spans)


@settings(max_examples=300, deadline=None)
@given(prompts, prompts)
def test_strict_alignment_is_the_exact_common_prefix(a_segs, b_segs):
    a, b = build(a_segs), build(b_segs)
    al = align(a, b, skip_volatile=False)
    n = al.request_depth
    assert al.entry_depth == n and al.stale_tokens == 0
    assert a.model_tokens[:n] == b.model_tokens[:n]
    longest = 0
    while (
        longest < min(len(a.model_tokens), len(b.model_tokens) - 1)
        and a.model_tokens[longest] == b.model_tokens[longest]
    ):
        longest += 1
    assert n == longest


@settings(max_examples=400, deadline=None)
@given(prompts, prompts, st.integers(0, 4))
def test_an_alignment_within_a_growth_bound_keeps_to_it(a_segs, b_segs, bound):
    """The KV a hit holds may outgrow the prompt by at most ``max_growth``
    positions (the row's reserved KV): the bounded alignment keeps to it, is
    still an alignment, and is the unbounded one whenever that fits."""
    a, b = build(a_segs), build(b_segs)
    al = align(a, b, skip_volatile=True, max_growth=bound)
    assert al.entry_depth - al.request_depth <= bound
    assert outside_spans(a, al.entry_depth) == outside_spans(b, al.request_depth)
    for key, depth in ((a, al.entry_depth), (b, al.request_depth)):
        assert not any(s.start < depth < s.end for s in key.spans)
    free = align(a, b, skip_volatile=True)
    if free.entry_depth - free.request_depth <= bound:
        assert al == free


@given(prompts)
def test_identical_prompts_reuse_all_but_the_last_token(segs):
    key = build(segs)
    al = align(key, key, skip_volatile=True)
    assert al.request_depth == len(key.model_tokens) - 1
    assert al.stale_tokens == 0


def test_new_timestamp_of_another_length_is_stepped_over():
    old = PromptKey.build([1, 2, 50, 51, 3, 4, 5, 6], [TokenSpan(2, 4, TS)])
    new = PromptKey.build([1, 2, 60, 61, 62, 3, 4, 5, 8], [TokenSpan(2, 5, TS)])
    al = align(old, new, skip_volatile=True)
    assert (al.entry_depth, al.request_depth, al.stale_tokens) == (7, 8, 2)
    assert old.canonical[:3] == new.canonical[:3]
    # strict stops at the first differing token
    assert align(old, new, skip_volatile=False).request_depth == 2


def test_difference_right_after_a_span_stops_at_the_span():
    old = PromptKey.build([1, 50, 3, 4], [TokenSpan(1, 2, TS)])
    new = PromptKey.build([1, 60, 9, 4, 0], [TokenSpan(1, 2, TS)])
    al = align(old, new, skip_volatile=True)
    # skipping the span would gain nothing and leave a stale value: cut before it
    assert (al.entry_depth, al.request_depth, al.stale_tokens) == (1, 1, 0)


def test_droppable_block_present_on_one_side_only():
    with_block = PromptKey.build([1, 2, 70, 71, 72, 3, 4, 5], [TokenSpan(2, 5, SR)])
    without = PromptKey.build([1, 2, 3, 4, 9], [])
    assert with_block.canonical[:4] == without.canonical[:4]
    al = align(with_block, without, skip_volatile=True)
    assert (al.entry_depth, al.request_depth) == (7, 4)
    # a reminder only the entry has is the request's own conversation's (it read it
    # on an earlier turn) or nobody's: another conversation's reminder (its plan
    # mode, its secrets) was read by a conversation that never sent it
    al = align(with_block, without, skip_volatile=True, entry_only_read=False)
    assert (al.entry_depth, al.request_depth) == (2, 2)
    # a block only the request has is prefilled: stepping over it, the model never
    # read it (a new <system-reminder> in the history, hidden by the hit)
    al = align(without, with_block, skip_volatile=True)
    assert (al.entry_depth, al.request_depth) == (2, 2)


def test_a_changed_reminder_is_prefilled_but_a_changed_envelope_is_stepped_over():
    """A reminder at the same place with other words (another project's
    instructions in another agent's first message) was stepped over like a stale
    timestamp: the model read the old reminder and never the new one."""
    old = PromptKey.build([1, 2, 70, 71, 3, 4, 5], [TokenSpan(2, 4, SR)])
    new = PromptKey.build([1, 2, 80, 81, 82, 3, 4, 9], [TokenSpan(2, 5, SR)])
    al = align(old, new, skip_volatile=True)
    assert (al.entry_depth, al.request_depth, al.stale_tokens) == (2, 2, 0)
    # the same reminder is reused; an envelope's changed ids stay stale values
    assert align(old, old, skip_volatile=True).request_depth == 6
    ic = RULE_INDEX["inbound_context"]
    old = PromptKey.build([1, 2, 70, 71, 3, 4, 5], [TokenSpan(2, 4, ic)])
    new = PromptKey.build([1, 2, 80, 81, 82, 3, 4, 9], [TokenSpan(2, 5, ic)])
    al = align(old, new, skip_volatile=True)
    assert (al.entry_depth, al.request_depth, al.stale_tokens) == (6, 7, 2)


def test_a_changed_value_in_the_newest_user_message_is_read_not_stepped_over():
    """A user who edits the time in their last message and regenerates: stepped
    over as a stale value, the model read the old time from reused KV. Earlier
    messages' values are still stepped over; only the prompt's tail prefills."""
    tokens = [1, 2, 50, 51, 3, 4, 5, 6, 60, 61, 7, 8, 9]
    spans = [TokenSpan(2, 4, TS), TokenSpan(8, 10, TS)]
    old = PromptKey.build(tokens, spans, newest_user_start=5)
    edited = [1, 2, 52, 53, 3, 4, 5, 6, 62, 63, 7, 8, 9]
    new = PromptKey.build(edited, spans, newest_user_start=5)
    al = align(old, new, skip_volatile=True)
    assert (al.entry_depth, al.request_depth, al.stale_tokens) == (8, 8, 2)
    # unchanged, it is reused like any other span
    assert align(old, old, skip_volatile=True).request_depth == len(tokens) - 1
    # a value in an earlier message (the newest user message starts after it)
    later = PromptKey.build(edited + [4, 4], spans, newest_user_start=11)
    al = align(old, later, skip_volatile=True)
    assert (al.entry_depth, al.request_depth, al.stale_tokens) == (13, 13, 4)


def test_a_reminder_joined_to_an_envelope_before_it_is_still_read_when_it_changes():
    """Spans that touch are joined and the first rule named the union: a reminder
    right after an Inbound Context block became an envelope, stepped over stale."""
    from kvcache.volatile_rules import MessageSlice, prompt_spans

    def key(reminder: str) -> PromptKey:
        text = (
            "sys.\n"
            + "Inbound Context\nchat: 5\n"
            + f"<system-reminder>{reminder}</system-reminder>\nGo on."
        )
        spans = prompt_spans(text, [MessageSlice(0, len(text), "user")])
        offsets = [(i, i + 1) for i in range(len(text))]
        return PromptKey.build([ord(c) for c in text], token_spans(offsets, spans))

    old, new = key("Use project A rules"), key("Use project B rules")
    assert [s.rule for s in new.spans] == [SR]
    al = align(old, new, skip_volatile=True)
    assert al.request_depth == len("sys.\n") and al.stale_tokens == 0


def test_token_spans_cover_tokens_that_straddle_a_span_edge():
    offsets = [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert token_spans(offsets, [CharSpan(4, 7, TS)]) == [TokenSpan(1, 3, TS)]
    assert token_spans(offsets, [CharSpan(6, 9, TS)]) == [TokenSpan(2, 3, TS)]
    assert token_spans(offsets, [CharSpan(12, 14, TS)]) == []


def test_canonicalise_and_chain_hashes():
    key = PromptKey.build([1, 2, 3, 4, 5], [TokenSpan(1, 3, TS)])
    assert key.canonical == (1, canonicalise([0, 0], [TokenSpan(0, 2, TS)])[0], 4, 5)
    h1 = chain_hashes([1, 2, 3, 4, 5], 2, "m")
    h2 = chain_hashes([1, 2, 3, 9, 5], 2, "m")
    assert len(h1) == 2 and h1[0] == h2[0] and h1[1] != h2[1]
    assert chain_hashes([1, 2], 2, "other-model") != chain_hashes([1, 2], 2, "m")


def test_canonical_position_maps_through_spans():
    key = PromptKey.build([1, 50, 51, 2, 70, 71, 3], [TokenSpan(1, 3, TS), TokenSpan(4, 6, SR)])
    assert key.canonical == (1, -1 - TS, 2, 3)
    assert key.canonical_position(3) == 2
    assert key.canonical_position(6) == 3
