"""Session records, session-id extraction and healing of stripped replies."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from app.session_id import session_id_from
from kvcache.healing import HealingStore, history_contexts, visible_form
from kvcache.sessions import ANCHOR_TOKENS, SessionStore, fallback_session_id


def test_a_turn_replaces_only_the_branch_it_strictly_extends():
    store = SessionStore()
    assert store.record_turn("s", ["sys", "u1"], [100, 120], entry_id=1)
    assert store.record_turn("s", ["sys", "u1", "a1", "u2"], [100, 120, 150, 170], entry_id=2)
    # a sub-agent branch from the same system prompt must not clobber the record
    assert not store.record_turn("s", ["sys", "sub"], [100, 130], entry_id=3)
    # nor does a mid-history edit
    assert not store.record_turn("s", ["sys", "u1-edited", "a1", "u2"], [100, 121, 151, 171], 4)
    assert store.branches_started == 2
    main = ["sys", "u1", "a1", "u2", "a2", "u3"]
    assert store.candidates("s", main)[0] == 2
    assert store.promised_tokens("s", main, [100, 120, 150, 170, 200, 220]) == 170
    # the sub-agent goes on in its own branch
    assert store.record_turn("s", ["sys", "sub", "a", "u"], [100, 130, 140, 150], entry_id=5)
    assert store.candidates("s", ["sys", "sub", "a", "u", "x"])[0] == 5
    assert store.candidates("s", main)[0] == 2


def test_a_side_request_sent_first_does_not_keep_the_session_for_good():
    """A client's title request opened the session; with one record per session no
    turn of the conversation itself appended to it, so none was ever recorded."""
    store = SessionStore()
    store.record_turn("s", ["title-sys", "summarise: hello"], [40, 60], entry_id=1)
    store.record_turn("s", ["sys", "hello"], [100, 120], entry_id=2)
    assert store.record_turn("s", ["sys", "hello", "a1", "u2"], [100, 120, 150, 170], 3)
    assert store.candidates("s", ["sys", "hello", "a1", "u2", "a2", "u3"]) == [3]
    assert store.promised_tokens("s", ["sys", "hello", "a1", "u2*"], [100, 120, 150, 171]) == 150
    assert store.candidates("s", ["title-sys", "summarise: more"]) == [1]


def test_branches_per_session_are_bounded_oldest_written_first():
    store = SessionStore(max_branches=2)
    store.record_turn("s", ["a"], [1], 1)
    store.record_turn("s", ["b"], [1], 2)
    store.record_turn("s", ["a", "a2"], [1, 2], 3)  # extends a: now the newest
    store.record_turn("s", ["c"], [1], 4)  # b, the least recently written, goes
    assert [r.entry_id for r in store.branches("s")] == [4, 3]
    assert store.messages_held == 3
    assert store.candidates("s", ["b", "b2"]) == []


def test_promised_tokens_end_at_the_change_point():
    store = SessionStore()
    store.record_turn("s", ["sys", "u1", "a1", "tool1", "a2"], [100, 120, 150, 400, 420], 7)
    # the tool result (message 4) was edited: everything before it is promised
    promised = store.promised_tokens(
        "s", ["sys", "u1", "a1", "tool1*", "a2", "u3"], [100, 120, 150, 390, 410, 430]
    )
    assert promised == 150
    assert store.promised_tokens("other", ["sys"], [100]) == 0


def test_lineage_keeps_anchors_as_the_conversation_grows():
    store = SessionStore()
    ends = []
    messages = []
    for turn in range(6):
        messages.append(f"m{turn}")
        ends.append((turn + 1) * ANCHOR_TOKENS)
        store.record_turn("s", messages, ends, entry_id=turn + 1)
    ids = store.candidates("s")
    assert ids[0] == 6 and len(ids) > 2 and set(ids) <= set(range(1, 7))


def test_records_are_bounded_by_the_messages_they_hold_not_only_their_count():
    """256 sessions of 8,192 messages each held 242 MiB of digests."""
    store = SessionStore(max_sessions=100, max_messages=10)
    four = [f"m{i}" for i in range(4)]
    store.record_turn("a", four, list(range(1, 5)), 1)
    store.record_turn("b", four, list(range(1, 5)), 2)
    store.record_turn("a", four + ["m4"], list(range(1, 6)), 3)  # growing refreshes it
    assert store.messages_held == 9
    store.record_turn("c", four, list(range(1, 5)), 4)  # 13 held: the oldest write goes
    assert store.get("b") is None and store.get("a") is not None
    assert store.messages_held == 9
    # a record larger than the whole bound stays alone: its own session still reuses
    store.record_turn("big", [f"x{i}" for i in range(12)], list(range(1, 13)), 5)
    assert len(store) == 1 and store.messages_held == 12 and store.candidates("big") == [5]
    store.forget("big")
    assert store.messages_held == 0


@given(st.lists(st.tuples(st.sampled_from("abcde"), st.integers(1, 6)), max_size=40))
def test_messages_held_is_the_sum_over_records(writes):
    store = SessionStore(max_sessions=3, max_messages=8)
    for session, n in writes:
        held = store.get(session)
        base = list(held.messages) if held else []
        store.record_turn(
            session,
            base + [f"{session}{len(base) + i}" for i in range(n)],
            [1] * (len(base) + n),
            1,
        )
        total = sum(len(r.messages) for s in "abcde" for r in store.branches(s))
        assert store.messages_held == total
        assert len(store) <= 3 and (total <= 8 or len(store) == 1)


def test_fallback_session_groups_by_the_head_of_the_cache_key():
    head = list(range(128))
    assert fallback_session_id(head + [1]) == fallback_session_id(head + [2])
    assert fallback_session_id([5] + head) != fallback_session_id(head)


def test_session_id_sources():
    assert session_id_from({"session_id": "a"}, {}) == "a"
    assert session_id_from({"metadata": {"conversation_id": "b"}}, {}) == "b"
    assert session_id_from({"extra_body": {"thread_id": 7}}, {}) == "7"
    assert session_id_from({"metadata": {"chat_id": " c "}}, {}) == "c"
    assert session_id_from({}, {"x-session-id": "d"}) == "d"
    assert session_id_from({"metadata": {"user": "x"}}, {}) is None
    assert session_id_from({"prompt_cache_key": "codex-1"}, {}) == "codex-1"
    # one key an app may share among its users: any conversation id named wins over it
    assert session_id_from({"prompt_cache_key": "app", "metadata": {"chat_id": "u1"}}, {}) == "u1"
    assert session_id_from({"prompt_cache_key": "app"}, {"x-session-id": "u2"}) == "u2"
    # healing's scope: never a cache key (its users would heal into each other's prompts)
    assert session_id_from({"prompt_cache_key": "app"}, {}, cache_key=False) is None
    assert (
        session_id_from({"prompt_cache_key": "app", "chat_id": "u1"}, {}, cache_key=False) == "u1"
    )
    assert session_id_from({}, {"session_id": "e"}) == "e"  # Codex: no x- prefix
    claude = {"metadata": {"user_id": "user_ab12_account_9f_session_5d1c-77"}}
    assert session_id_from(claude, {}) == "5d1c-77"
    assert session_id_from({"metadata": {"user_id": "user_ab12"}}, {}) is None
    # Claude Code since v2.1.78: the user id is a JSON object, the session inside it
    user = json.dumps({"device_id": "d1", "account_uuid": "a1", "session_id": "5d1c-78"})
    assert session_id_from({"metadata": {"user_id": user}}, {}) == "5d1c-78"
    assert session_id_from({"metadata": {"user_id": '{"device_id": "d1"}'}}, {}) is None
    assert session_id_from({"metadata": {"user_id": "{not json"}}, {}) is None


def test_healing_restores_stripped_think_blocks_and_tool_call_arguments():
    store = HealingStore()
    original = "<think>\nthe user wants 4\n</think>\n\nThe answer is 4."
    store.remember(original)
    echoed = {"role": "assistant", "content": "The answer is 4."}
    assert store.heal(echoed)["content"] == original
    assert store.healed == 1
    # verbatim echoes and unknown replies pass through
    assert store.heal({"role": "assistant", "content": original})["content"] == original
    assert (
        store.heal({"role": "assistant", "content": "something else"})["content"]
        == "something else"
    )
    assert (
        store.heal({"role": "user", "content": "The answer is 4."})["content"] == "The answer is 4."
    )

    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": 2}'}}
    ]
    store.remember("", calls)
    reserialised = [
        {"id": "x9", "type": "function", "function": {"name": "f", "arguments": '{"b":2,"a":1}'}}
    ]
    healed = store.heal({"role": "assistant", "content": None, "tool_calls": reserialised})
    assert healed["tool_calls"] == calls


def test_messages_that_still_carry_reasoning_are_never_swapped():
    """A client-written few-shot answer whose visible text equals a generated reply
    keeps its own think block."""
    store = HealingStore()
    store.remember("<think>\nmodel reasoning\n</think>\nIt lists files.")
    shot = {
        "role": "assistant",
        "content": "<think>\nfew-shot reasoning\n</think>\nIt lists files.",
    }
    assert store.heal(shot) == shot and store.healed == 0


def test_same_visible_text_in_different_places_heals_to_its_own_original():
    store = HealingStore()
    q1 = {"role": "user", "content": "first question"}
    q2 = {"role": "tool", "content": "tool output"}
    history = [
        q1,
        {"role": "assistant", "content": "Done."},
        q2,
        {"role": "assistant", "content": "Done."},
    ]
    contexts = history_contexts(history)
    store.remember("reasoning one</think>Done.", context=contexts[1])
    store.remember("reasoning two</think>Done.", context=contexts[3])
    healed = store.heal_all(history)
    assert healed[1]["content"] == "reasoning one</think>Done."
    assert healed[3]["content"] == "reasoning two</think>Done."


def _turns(system: str, replies: list[str]) -> list[dict]:
    """An agent loop: the same tool result, answered with the same visible reply."""
    out = [{"role": "system", "content": system}]
    for reply in replies:
        out += [{"role": "user", "content": "continue"}, {"role": "assistant", "content": reply}]
    return out


def test_a_reply_heals_back_only_where_it_was_generated():
    """Keyed by the message before it alone, a reply healed into another agent's
    conversation (its reasoning read by the other's model) and into every earlier
    turn with the same visible text."""
    store = HealingStore()
    for agent in ("A", "B"):  # same last message, same visible reply, other histories
        history = _turns(f"You are agent {agent}.", [])
        history.append({"role": "user", "content": "continue"})
        store.remember(f"{agent} reasons</think>Done.", context=history_contexts(history)[-1])
    echo = _turns("You are agent A.", ["Done."])
    assert store.heal_all(echo)[2]["content"] == "A reasons</think>Done."
    # a loop answering alike each turn: each turn heals to its own reasoning
    loop = _turns("sys", [])
    for turn in range(3):
        loop.append({"role": "user", "content": "continue"})
        store.remember(f"attempt {turn}</think>Done.", context=history_contexts(loop)[-1])
        loop.append({"role": "assistant", "content": "Done."})
    healed = store.heal_all(loop)
    assert [m["content"] for m in healed[2::2]] == [f"attempt {t}</think>Done." for t in range(3)]
    # the same text beside another image (the salt) or in another session: no heal
    alone = _turns("sys", ["Done."])
    store.remember(
        "image one</think>Done.", context=history_contexts(alone[:2], salts=[b"", b"1"])[-1]
    )
    assert (
        store.heal_all(alone, history_contexts(alone, salts=[b"", b"2"]))[2]["content"] == "Done."
    )
    assert (
        store.heal_all(alone, history_contexts(alone, "s2", [b"", b"1"]))[2]["content"] == "Done."
    )
    assert store.heal_all(alone, history_contexts(alone, "", [b"", b"1"]))[2]["content"] != "Done."


def test_a_timestamp_that_changes_every_turn_does_not_stop_healing():
    """Agents resend their system prompt with the current time each turn: the
    place a reply was generated in is the same place."""
    store = HealingStore()
    turn = _turns("Be brief.\nCurrent time is 10:42", [])
    turn.append({"role": "user", "content": "continue"})
    store.remember("r</think>Done.", context=history_contexts(turn)[-1])
    later = _turns("Be brief.\nCurrent time is 10:57", ["Done."])
    assert store.heal_all(later)[2]["content"] == "r</think>Done."


def test_an_edited_reasoning_is_never_healed_over():
    """The client's edit of the reasoning (sent apart, or kept inline before the
    closing tag) was replaced by the original: the model never read it."""
    store = HealingStore()
    original = "<think>I will rm -rf the build dir</think>\n\nDone."
    store.remember(original)
    edited = {"role": "assistant", "content": "Done.", "reasoning_content": "never delete anything"}
    assert store.heal(edited) == edited
    inline = {"role": "assistant", "content": "never delete anything</think>\n\nDone."}
    assert store.heal(inline) == inline
    assert store.healed == 0
    # unedited, sent apart or partly kept inline: healed
    same = {
        "role": "assistant",
        "content": "Done.",
        "reasoning_content": "I will rm -rf the build dir",
    }
    assert store.heal(same)["content"] == original and "reasoning_content" not in store.heal(same)
    assert (
        store.heal({"role": "assistant", "content": "the build dir</think>\n\nDone."})["content"]
        == original
    )


def test_a_full_store_evicts_other_conversations_before_a_long_ones_oldest_replies():
    """Healing touched replies oldest first, so a full store evicted the oldest
    reply still in use: each turn after re-prefilled nearly the whole history."""
    store = HealingStore(max_entries=8)
    history = _turns("sys", [])
    for turn in range(8):
        history.append({"role": "user", "content": f"step {turn}"})
        store.remember(f"r{turn}</think>ok {turn}", context=history_contexts(history)[-1])
        history.append({"role": "assistant", "content": f"ok {turn}"})
    store.heal_all(history)  # this turn's request: every earlier reply used
    store.remember("another agent's reply")  # the store is full: one goes
    healed = store.heal_all(history)
    assert healed[2]["content"] == "r0</think>ok 0"  # the oldest is still there
    assert sum("</think>" in m["content"] for m in healed) == 7  # the newest went


def test_healing_store_is_bounded():
    store = HealingStore(max_entries=3, max_bytes=10**6)
    for i in range(10):
        store.remember(f"reply {i}")
    assert len(store) == 3
    small = HealingStore(max_entries=100, max_bytes=50)
    for i in range(10):
        small.remember(f"a longer reply number {i}")
    assert small.nbytes <= 50


def test_visible_form():
    assert visible_form("<think>x</think>  hi ") == "hi"
    assert visible_form("pre-opened reasoning</think>answer") == "answer"
    # a client that cut at the first closing tag and one that cut at the last agree
    twice = "reasoning</think>\ndraft</think>\nanswer"
    assert visible_form(twice) == visible_form("draft</think>\nanswer") == "answer"


# the regexes visible_form used to run (quadratic on unclosed tags): the reference
_OLD_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_OLD_OPEN_THINK = re.compile(r"^.*</think>", re.DOTALL)


def old_visible_form(content: str) -> str:
    text = _OLD_THINK.sub("", content)
    if "</think>" in text:
        text = _OLD_OPEN_THINK.sub("", text, count=1)
    return text.strip()


# "</th" and "ink>" around a removed block join into a new closing tag
_FRAGMENTS = ("<think>", "</think>", "<th", "</th", "ink>", "</", "<", ">", "\n", " ", "\t", "x")


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=40).map("".join))
def test_visible_form_equals_the_regex_form_it_replaced(text: str) -> None:
    assert visible_form(text) == old_visible_form(text)


def test_a_partly_stripped_echo_is_healed():
    store = HealingStore()
    original = "reasoning</think>\ndraft</think>\nanswer"
    store.remember(original)
    echoed = {"role": "assistant", "content": "draft</think>\nanswer"}
    assert store.heal(echoed)["content"] == original


def test_a_resent_history_is_chained_from_remembered_places(monkeypatch):
    """Each turn resends every message: canonicalising all of them again cost 18 ms a
    turn at 1,000 messages. The memo gives the same chain, computing only new ones."""
    import kvcache.healing as healing

    history = _turns("Be brief.\nCurrent time is 10:42", ["Done.", "ok"])
    store = HealingStore()
    assert store.contexts(history, "s") == history_contexts(history, "s")
    computed: list[dict] = []
    place = healing._place  # noqa: SLF001
    monkeypatch.setattr(healing, "_place", lambda m, strict: computed.append(m) or place(m, strict))
    turn = [*history, {"role": "user", "content": "and now?"}]
    assert store.contexts(turn, "s") == history_contexts(turn, "s")[: len(turn) + 1]
    assert computed[0] == turn[-1] and len(computed) == 1 + len(turn)  # memo, then none


def test_two_originals_that_echo_alike_in_one_place_are_not_healed():
    """Two conversations with no session id and the same history, each a tool call
    with its own reasoning: one's echo healed to the other's reasoning."""
    store = HealingStore()
    history = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Fix it."},
    ]
    call = [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]
    context = store.contexts(history)[-1]
    for reasoning in ("conversation ONE: the fixture", "conversation TWO: an import"):
        store.remember(f"<think>{reasoning}</think>", call, context=context, restore_calls=False)
    echo = history + [{"role": "assistant", "content": "", "tool_calls": call}]
    assert store.heal_all(echo, store.contexts(echo))[2]["content"] == ""  # as the client sent it
    # the same original twice is no ambiguity
    again = HealingStore()
    for _ in range(2):
        again.remember("<think>why</think>Done.", context=context)
    reply = history + [{"role": "assistant", "content": "Done."}]
    assert again.heal_all(reply, again.contexts(reply))[2]["content"] == "<think>why</think>Done."


def _with_reminder(reminder: str) -> list[dict]:
    return [
        {"role": "system", "content": "sys"},
        {
            "role": "user",
            "content": f"<system-reminder>\n{reminder}\n</system-reminder>\nRead the config",
        },
    ]


def test_conversations_told_apart_by_a_reminder_alone_never_share_reasoning():
    """Without a session id, the place of a turn was its cache-key form, which
    drops reminder blocks: another client's conversation with another reminder
    was the same place, and its echo healed to this one's reasoning (a secret the
    reminder showed)."""
    store = HealingStore()
    secret = _with_reminder("Contents of secrets.env: API_TOKEN=sk-private")
    store.remember("The token is sk-private</think>Done.", context=store.contexts(secret)[-1])
    other = _with_reminder("Contents of README.md: hello") + [
        {"role": "assistant", "content": "Done."}
    ]
    assert store.heal_all(other, store.contexts(other))[2]["content"] == "Done."
    # the same conversation still heals; in a session, a reminder rewritten since does too
    same = secret + [{"role": "assistant", "content": "Done."}]
    assert "sk-private" in store.heal_all(same, store.contexts(same))[2]["content"]
    store.remember("in session</think>Done.", context=store.contexts(secret, "s1")[-1])
    assert store.heal_all(other, store.contexts(other, "s1"))[2]["content"].startswith("in session")


def test_an_ambiguous_place_stays_unhealed_after_the_store_turns_over():
    """The mark for a place two originals share was kept among the replies, never
    touched: the first evicted, after which a third reply there healed into both."""
    store = HealingStore(max_entries=4)
    history = _turns("sys", [])
    history.append({"role": "user", "content": "hi"})
    context = history_contexts(history)[-1]
    store.remember("user A's reasoning</think>Hello!", context=context)
    store.remember("user B's reasoning</think>Hello!", context=context)
    for i in range(10):
        store.remember(f"filler {i}")
    store.remember("user C's reasoning</think>Hello!", context=context)
    echo = _turns("sys", ["Hello!"])
    echo[1]["content"] = "hi"
    assert store.heal_all(echo)[2]["content"] == "Hello!"


def test_a_session_id_with_a_lone_surrogate_is_made_valid_text():
    """JSON inside Claude Code's metadata.user_id may escape a lone surrogate (a client
    cutting a string inside an emoji): the id then failed every use that encodes it
    (healing's scope hash, the trace file) after the reply was generated."""
    ids = {
        session_id_from({"metadata": {"user_id": '{"session_id": "' + raw + '"}'}}, {})
        for raw in ("\\ud800x", "\\udc00x", "\\ud83dx")
    }
    assert len(ids) == 3  # distinct ids stay distinct
    for found in ids:
        assert found is not None and found.encode("utf-8")  # no UnicodeEncodeError
    assert "\\ud800x" in ids  # shown as its escape
    assert session_id_from({"session_id": "a\udfffb"}, {}) == "a\\udfffb"
    assert session_id_from({}, {"x-session-id": "\ud800"}) == "\\ud800"
    assert session_id_from({"metadata": {"user_id": "u_session_\ud800"}}, {}) == "\\ud800"
    assert session_id_from({"session_id": "é-ok"}, {}) == "é-ok"  # valid text unchanged
