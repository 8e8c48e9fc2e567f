"""Each volatile rule, on its own: what it marks, and what it must leave alone."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.volatile_rules import (
    RULE_INDEX,
    RULES,
    Block,
    MessageSlice,
    canonical_text,
    find_in_text,
    prompt_spans,
    relocate_volatile_lines,
)


def marked(text: str) -> list[tuple[str, str]]:
    return [(RULES[s.rule].name, text[s.start : s.end]) for s in find_in_text(text)]


@pytest.mark.parametrize(
    "text, rule, span",
    [
        (
            "x-anthropic-billing-header: cc_version=2.0.14; cch=9f3a1;\nYou are Claude Code.",
            "billing_header",
            "x-anthropic-billing-header: cc_version=2.0.14; cch=9f3a1;",
        ),
        ("session cch=00ff12; more", "cch_nonce", "cch=00ff12;"),
        (
            "Intro.\nCurrent time is 2026-11-26 10:42:01 UTC\nRules.",
            "timestamp",
            "2026-11-26 10:42:01 UTC",
        ),
        ("Current date: Thursday, November 26", "timestamp", "Thursday, November 26"),
        ("Today's date is 2026-11-26.", "timestamp", "2026-11-26."),
        (
            "Current date: Thursday, November 26, 2026 at 10:42 AM (Europe/Paris)",
            "timestamp",
            "Thursday, November 26, 2026 at 10:42 AM (Europe/Paris)",
        ),
        (
            "Be brief. Current time is 2026-11-26T10:42:01.5+01:00",
            "timestamp",
            "2026-11-26T10:42:01.5+01:00",
        ),
        (
            "Current time in ISO 8601 UTC format: 2026-11-27T10:42:01.000Z",  # Roo / Kilo Code
            "timestamp",
            "2026-11-27T10:42:01.000Z",
        ),
        (
            "Current date: Thu Nov 27 2026 10:42:01 GMT+0100 (Central European Standard Time)",
            "timestamp",
            "Thu Nov 27 2026 10:42:01 GMT+0100 (Central European Standard Time)",
        ),
        ("Current time: 10:42 (UTC+01:00)", "timestamp", "10:42 (UTC+01:00)"),
        ("Current date: 2026-11-27 (Thursday)", "timestamp", "2026-11-27 (Thursday)"),
        ("Fix it [message_id: 8812]", "message_id", "8812"),
        ("message_id=abc\nthe text", "message_id", "abc"),
        ("From: bob | message_id: m-77 | 10 KB", "message_id", "m-77"),
        ("Today is Monday", "timestamp", "Monday"),
        ("Current time: 1732712345", "timestamp", "1732712345"),
        ("Current time: 3 PM", "timestamp", "3 PM"),
        ("Current time: 10 AM UTC", "timestamp", "10 AM UTC"),
        ("Current date: 20260131", "timestamp", "20260131"),
        ("Current time: 20260131T104201Z", "timestamp", "20260131T104201Z"),
        ("Today is the 31st", "timestamp", "the 31st"),
        ("Current time: 10h42", "timestamp", "10h42"),
        # a label opens a line (after a list marker or a quote), a sentence or a tag
        ("- Current time: 10:42 UTC", "timestamp", "10:42 UTC"),
        ("> Today is Monday", "timestamp", "Monday"),
        ("<env>Today's date: 2026-11-26", "timestamp", "2026-11-26"),
        ("Hi! Today is Monday", "timestamp", "Monday"),
        ("Notes:\n  * Today's date is 2026-11-26.", "timestamp", "2026-11-26."),
        ("chat_id=5 message_id=77", "message_id", "77"),
        ("[Telegram Bob id:1 message_id: 4411]", "message_id", "4411"),
        ('{"message_id": "abc-12"}', "message_id", "abc-12"),
        # OpenClaw's pretty-printed conversation info, a bridge's parenthesis, a pair
        ('{\n  "message_id": "dbce89ac-9ea2",\n  "chat": 5\n}', "message_id", "dbce89ac-9ea2"),
        ("(message_id: 4411) hi", "message_id", "4411"),
        ("chat_id=5 message_id=4411", "message_id", "4411"),
        (
            'Hello\n## Inbound Context (trusted metadata)\n```json\n{"chat": 5}\n```\nBye',
            "inbound_context",
            '## Inbound Context (trusted metadata)\n```json\n{"chat": 5}\n```\n',
        ),
        (
            "Done.\nStats: runtime 42s • tokens 1.2k\nResult: ok",
            "subagent_stats",
            "Stats: runtime 42s • tokens 1.2k\n",
        ),
        (
            "<system-reminder>\nTodo list is empty\n</system-reminder>\nfix the test",
            "system_reminder",
            "<system-reminder>\nTodo list is empty\n</system-reminder>\n",
        ),
    ],
)
def test_rule_marks_exactly_its_span(text, rule, span):
    assert (rule, span) in marked(text)
    # nothing else in these texts is volatile
    assert all(name == rule or name in ("cch_nonce", "billing_header") for name, _ in marked(text))


@pytest.mark.parametrize(
    "text",
    [
        "The current implementation is fine.",  # 'current' without a date/time label
        "def cch(x): return x",
        "timestamps like 2026-11-26 in code are content",
        "message ids are described in the docs",
        "Inbound requests are handled by the router.",
        # the user's words after "today is": an edit to them must reach the model
        "What I need today is a script that lists the files in ./build",
        "What I need today is 3 scripts, by Monday",
        "Current time is 10:42, and then delete ~/.ssh",
        "Current time is " + "9 " * 60,  # no date is that long
        # a number or an upper-case word after "today is" is no date: an edit of the
        # user's value must reach the model, not be stepped over as a stale timestamp
        "The dose today is 20",
        "blood sugar today is 250",
        "The password today is ABCDE",
        "The answer today is NO",
        "the limit today is 5 USD",
        # a message id in the user's own text is no channel envelope
        "DELETE FROM inbox WHERE message_id = 4411",
        "UPDATE t SET done=1, message_id = 4411 WHERE x=1;",
        "UPDATE t SET done=1,message_id = 4411 WHERE x=1;",
        "UPDATE inbox SET message_id=4411",
        "bot.delete_message(chat_id=5, message_id=4411)",
        "requests.post(url, json={'message_id': 4411})",
        "send(message_id=4411)",
        'payload = {\n    "message_id": 4411,\n    "chat": 5\n}',
        "    'message_id': 4411,",
        "level=info msg=sent message_id=4411 chat=5",
        "def delete(message_id: int) -> None:",
        "fn get(message_id: u64) -> Msg {",
        # a number with one separator is no date: the user's dose, not a stale value
        "The insulin dose I took today is 2.5",
        "The ratio today is 3/4",
        "The score today is 10-3",
        "The price today is 1234.50",
        "The version today is 2024.13",
        # a document about inbound context is no envelope: its code is the user's
        "## Inbound context handling\n```python\nx = 1\n```\nwhy is x 1?",
        # after a date: a branch is no IANA zone, a dose no part of a time
        "Today is 2026-01-05 on release/v1",
        "Current time: 10:42 500mg",
        "look up the row whose message id: 12 failed",
        # "today is" inside the user's sentence is no label: an edit of the time
        # they wrote, stepped over as a stale timestamp, never reached the model
        "My flight today is at 10:30 pm\nWhen should I leave for the airport?",
        "The standup today is at 9:30",
        "Our deadline today is 17:00 UTC",
        "so the current time is 10:42",
        # a bracket, bar, bullet or parenthesis must be right before the label
        "[cron] My flight today is at 10:30 pm",
        "(see above) so the current time is 10:42",
        "a | the standup today is at 9:30",
        "• My flight today is at 10:30 pm",
    ],
)
def test_ordinary_text_is_not_volatile(text):
    assert marked(text) == []


@pytest.mark.parametrize(
    "text, rule, span",
    [
        # after a date, a parenthesis or an upper-case word is the user's unless it
        # names a zone: an edit of it, stepped over as a stale value, never reached
        # the model ("(deploy to staging)" read on as "(deploy to prod)")
        ("Today is Monday (deploy to staging)", "timestamp", None),
        ("current date is 2024-01-01 ABORT", "timestamp", None),
        ("Current time: 10:42 (ask me before pushing)", "timestamp", None),
        ("Current date: Monday (Central European Time)", "timestamp", "Monday (Central European Time)"),
        # the unfenced metadata block is its "key: value" lines, not the question after them
        ("Inbound Context\nchat: 5\nDelete the prod database", "inbound_context", "Inbound Context\nchat: 5\n"),
        ("## Inbound Context\n- sender: bob\n- chat id: 5\n\nhi", "inbound_context", "## Inbound Context\n- sender: bob\n- chat id: 5\n"),
        # a "word: text" line is the user's unless its word is an envelope's key
        ("Inbound Context\nchat: 5\nTask: delete the staging database\n", "inbound_context", "Inbound Context\nchat: 5\n"),
        ("Inbound Context\nMessage ID: 7\nReply-To ID: 12\nNote: hi", "inbound_context", "Inbound Context\nMessage ID: 7\nReply-To ID: 12\n"),
        # no free-text key: "message:" or "to:" may lead the user's own words
        ("Inbound Context\nchat: 5\nmessage: delete the prod database", "inbound_context", "Inbound Context\nchat: 5\n"),
        ("Inbound Context\nto: ops\n", "inbound_context", "Inbound Context\n"),
        # a fence of code after the header is the user's, not the envelope's JSON
        ("Inbound Context\n```python\nx = 1\n```\n", "inbound_context", "Inbound Context\n"),
        ('{"message_id" : "m-9"}', "message_id", "m-9"),
        ("Current time: 10:42 (US/Eastern)", "timestamp", "10:42 (US/Eastern)"),
        ("Current date: 2026-11-27 at 10:42 (America/Argentina/Salta)", "timestamp", "2026-11-27 at 10:42 (America/Argentina/Salta)"),
    ],
)  # fmt: skip
def test_a_volatile_value_ends_where_the_users_words_begin(text, rule, span):
    assert marked(text) == ([(rule, span)] if span else [])


def test_blank_lines_after_an_envelope_header_stay_linear():
    """Three quantifiers could each take a key line's leading blanks: 8k spaces
    after "Inbound Context" took 2.4 s, growing with the square of the line."""
    import time

    began = time.perf_counter()
    for blank in (" ", " \t"):
        assert marked("Inbound Context\n" + blank * 20_000 + "x") == [
            ("inbound_context", "Inbound Context\n")
        ]
    assert time.perf_counter() - began < 5  # milliseconds now; a minute before


def test_a_line_of_id_pairs_stays_linear():
    """The id-pair lead of a message_id ("chat_id=5 message_id=77") read ':' as part
    of a value: on "xid:xid:..." each word start scanned to the line's end (13 s for
    100 KB of one user message, the GIL held)."""
    import time

    began = time.perf_counter()
    for unit in ("xid:", "id:", "a_id=1:"):
        assert marked(unit * (100_000 // len(unit))) == []
    assert time.perf_counter() - began < 5  # milliseconds now; 40 s before


def test_a_label_followed_by_words_that_read_as_two_kinds_stays_linear():
    """ "AM" is a meridiem and a zone, "MAY" a month and a zone: a pattern of
    alternating words tried 2^n ways on a line that was no date (80 s a line)."""
    import time

    lines = "".join("Today is " + f"{word} " * 26 + "!\n" for word in ("AM", "MAY", "ON"))
    began = time.perf_counter()
    assert marked(lines * 300) == []
    assert time.perf_counter() - began < 5  # milliseconds now; hours before


@pytest.mark.parametrize(
    "text",
    [
        # Mistral v3/v7, Devstral: the template's tag closes with "]" right before it
        "<s>[SYSTEM_PROMPT]Current date: 2026-01-05 10:42 UTC\nYou are careful.",
        "<s>[INST]Current time: 10:42\nFix the bug.[/INST]",
        "[cron] Current time: 10:42",
        "a | Current time: 10:42",
        "• Current time: 10:42",
        "  •\tCurrent time: 10:42",
        "1) Current date: 10:42",
        "Status (live)Current time: 10:42",
    ],
)
def test_a_label_after_a_bracket_bar_bullet_or_parenthesis_is_read(text: str) -> None:
    """A label right after a template tag's "]", a table's "|", a bullet or a
    numbered item's ")": anchoring it to a line's or a sentence's start lost them,
    and a Mistral system prompt's changed clock ended every hit (27 of 195 tokens)."""
    value = re.search(r"(?:date|time): (.*)$", text, re.MULTILINE)
    assert value is not None
    assert marked(text) == [("timestamp", value.group(1))]


@pytest.mark.parametrize("run", [">", "> ", ">\t", "-", " #", "]", "] ", "|", "•\t", ")", ") "])
def test_a_long_run_of_markers_before_a_label_is_read_once(run: str) -> None:
    """A label may follow list markers at a line's start or a tag's ">": a lead
    that could start after every ">" of a run and read the run's rest took the
    square of its length (a run of 40k ">" took 23 s; 200k outlast the test
    timeout). No time is asserted: a quadratic scan fails by the timeout."""
    text = run * (200_000 // len(run)) + "Today is Monday"
    assert marked(text) == [("timestamp", "Monday")]


def test_every_rule_is_exercised():
    assert set(RULE_INDEX) == {r.name for r in RULES}


def test_rules_never_cross_a_message_boundary():
    a = "<|system|>Current time is 10:00"
    b = "<|user|><system-reminder>x"
    c = "</system-reminder>"  # the closing tag sits in the next message
    text = a + b + c
    slices = [
        MessageSlice(0, len(a), "system"),
        MessageSlice(len(a), len(a) + len(b), "user"),
        MessageSlice(len(a) + len(b), len(text), "user"),
    ]
    spans = prompt_spans(text, slices)
    assert [(RULES[s.rule].name, text[s.start : s.end]) for s in spans] == [("timestamp", "10:00")]


@pytest.mark.parametrize(
    "end",
    [
        "<|im_end|>",
        "<|eot_id|>",
        "<end_of_turn>",
        "</s>",
        "<|end|> ",
        "[/INST]",
        "[/SYSTEM_PROMPT]",
    ],
)
def test_a_timestamp_closing_its_message_is_found_before_the_end_of_turn_tag(end):
    # a clock on a system prompt's last line shares its line with the template's
    # end-of-turn tag: a changed value there ended every hit
    text = "<|im_start|>system\nBe brief.\nCurrent time: 10:42" + end + "\n"
    spans = prompt_spans(text, [MessageSlice(0, len(text), "system")])
    assert [(RULES[s.rule].name, text[s.start : s.end]) for s in spans] == [("timestamp", "10:42")]


def test_a_tag_inside_a_timestamps_line_is_not_an_end_of_turn():
    text = "Current time: 10:42 <b>late</b>"
    assert prompt_spans(text, [MessageSlice(0, len(text), "system")]) == []


def test_tool_and_assistant_messages_are_never_volatile():
    text = "Current time is 10:00"
    for role in ("tool", "assistant"):
        assert prompt_spans(text, [MessageSlice(0, len(text), role)]) == []
    assert prompt_spans(text, [MessageSlice(0, len(text), "user")])


def test_canonical_text_hides_values_and_drops_droppable_blocks():
    a = "Now.\nCurrent time is 10:00\n<system-reminder>a</system-reminder>\nGo"
    b = "Now.\nCurrent time is 11:59:59\nGo"
    ca = canonical_text(a, find_in_text(a))
    cb = canonical_text(b, find_in_text(b))
    assert ca == cb
    assert "10:00" not in ca


def test_relocate_moves_volatile_lines_to_the_last_message():
    contents = [
        "System rules.\nCurrent time is 10:00\nMore rules.",
        "hi",
        "question [message_id: 7]",
    ]
    roles = ["system", "assistant", "user"]
    out = relocate_volatile_lines(contents, roles)
    assert out == [
        "System rules.\nMore rules.",
        "hi",
        "question [message_id: 7]\n\nCurrent time is 10:00",
    ]


def test_relocate_leaves_lines_holding_an_image_where_they_are():
    """Images fill placeholders in the order the client sent them: a screenshot in
    a reminder moved after the last message's own image swapped their pixels."""
    contents = [
        "System rules.\nCurrent time is 10:00\nMore rules.",
        "<system-reminder>\nscreen: <image>\n</system-reminder>\nwhat is on it?",
        "ok",
        "and here <image>",
    ]
    roles = ["system", "user", "assistant", "user"]
    out = relocate_volatile_lines(contents, roles, fixed="<image>")
    assert out == [
        "System rules.\nMore rules.",
        contents[1],  # its reminder holds an image: it stays, volatile value and all
        "ok",
        "and here <image>\n\nCurrent time is 10:00",
    ]
    assert relocate_volatile_lines(contents, roles)[1] == "what is on it?"  # no images: moved


def test_relocate_keeps_tool_results_untouched():
    contents = ["Current time is 10:00", "go"]
    assert relocate_volatile_lines(contents, ["tool", "user"]) == contents


# the lazy regex system_reminder used to be (quadratic on unclosed tags): the reference
_OLD_SYSTEM_REMINDER = re.compile(r"<system-reminder>.*?</system-reminder>\n?", re.DOTALL)
_FRAGMENTS = (
    "<system-reminder>",
    "</system-reminder>",
    "<system-",
    "reminder>",
    "</",
    "<",
    ">",
    "\n",
    "```",
    "Inbound Context",
    " ",
    "x",
)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=40).map("".join))
def test_system_reminder_marks_what_the_lazy_regex_marked(text: str) -> None:
    found = RULES[RULE_INDEX["system_reminder"]].find(text)
    assert list(found) == [m.span() for m in _OLD_SYSTEM_REMINDER.finditer(text)]


tags = st.text("ab\n", min_size=1, max_size=3)


@settings(max_examples=500, deadline=None)
@given(tags, tags, st.sampled_from(("", "\n", "a", "ab")), st.text("ab\n", max_size=30))
def test_a_block_finds_what_its_lazy_regex_finds(
    open_tag: str, close_tag: str, trailer: str, text: str
) -> None:
    """Self-overlapping and mutually overlapping tags included."""
    lazy = re.compile(
        f"{re.escape(open_tag)}.*?{re.escape(close_tag)}(?:{re.escape(trailer)})?", re.DOTALL
    )
    found = Block(open_tag, close_tag, trailer)(text)
    assert list(found) == [m.span() for m in lazy.finditer(text)]


def test_relocate_moves_all_of_a_block_that_starts_on_a_moved_line():
    """A multi-line span (a system reminder) beginning on a line already moved for
    another span: the rest of it moves too, no half block left in the prefix."""
    first = (
        "[message_id: 8812] <system-reminder>\nThe user opened foo.py\n</system-reminder>\n"
        "You are a helpful agent.\n"
    )
    out = relocate_volatile_lines([first, "hi"], ["user", "user"])
    assert out[0] == "You are a helpful agent.\n"
    assert "The user opened foo.py" in (out[1] or "") and "</system-reminder>" in (out[1] or "")


def test_relocated_lines_go_to_the_last_user_message_not_a_prefill_or_tool_result():
    contents = ["You are X.\nCurrent time is 10:42:01", "hi", '{"answer": ']
    out = relocate_volatile_lines(contents, ["system", "user", "assistant"])
    assert out == ["You are X.\n", "hi\n\nCurrent time is 10:42:01", '{"answer": ']
    tool = relocate_volatile_lines(contents[:2] + ["exit 0"], ["system", "user", "tool"])
    assert tool[2] == "exit 0" and tool[1].endswith("Current time is 10:42:01")
