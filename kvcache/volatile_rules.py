"""Which bytes of a rendered prompt are volatile (change every turn without meaning
anything for the cache): one table of rules, each tested on its own.

Rules run inside one message's rendered text at a time, so no pattern can span
two messages, and only on system and user messages: tool results, file
contents, assistant replies (think blocks) and images always reach the model
and the cache key intact. Most rules are line-scoped; the two block rules are
bounded by their own closing marker inside the message.

Client text is adversarial input, so every rule scans in time linear in the
message: a regex rule's match attempts stop at their line end or at the end of
one character-class run (inbound_context's fence scan: see its comment), and a
block whose closing marker may be far away is found with ``str.find``
(``Block``) rather than a lazy ``.*?``, which would rescan the rest of the
message once per unclosed opening marker.

A rule's ``canonical`` form says what the cache key holds in the span's place:
``SENTINEL`` (one placeholder token: present-with-any-value vs absent differ) or
``DROP`` (nothing: present and absent canonicalise the same); its ``stale_ok``
whether KV of an older value may stand for a new one (``kvcache.prompt_key.align``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass


class Canonical(enum.Enum):
    SENTINEL = "sentinel"
    DROP = "drop"


Finder = Callable[[str], Iterable[tuple[int, int]]]  # text -> its (start, end) spans, in order


@dataclass(frozen=True)
class VolatileRule:
    name: str
    find: Finder
    canonical: Canonical
    # whether a changed value may be stepped over, the model keeping the old one
    # (a timestamp, a nonce, an envelope's ids): False where the text is something
    # to read (a reminder's instructions), whose new version must be prefilled
    stale_ok: bool = True


@dataclass(frozen=True)
class Regex:
    """The ``group`` span of each match of a pattern."""

    pattern: re.Pattern[str]
    group: int = 0  # 0: the whole match

    def __call__(self, text: str) -> Iterator[tuple[int, int]]:
        for m in self.pattern.finditer(text):
            yield m.span(self.group)


@dataclass(frozen=True)
class Block:
    """What ``re.finditer(open.*?close(?:trailer)?, DOTALL)`` finds, in linear time."""

    open: str
    close: str
    trailer: str = ""

    def __call__(self, text: str) -> Iterator[tuple[int, int]]:
        return tag_blocks(text, self.open, self.close, self.trailer)


def tag_blocks(
    text: str, open_tag: str, close_tag: str, trailer: str = ""
) -> Iterator[tuple[int, int]]:
    """Spans from each ``open_tag`` through the nearest ``close_tag`` after it (and
    ``trailer`` if it follows), left to right without overlap, like a lazy regex.
    One pass over the text: when an opening tag has no closing tag after it, no
    later one has either, so the scan stops there."""
    pos = 0
    while (start := text.find(open_tag, pos)) >= 0:
        close = text.find(close_tag, start + len(open_tag))
        if close < 0:
            return
        pos = close + len(close_tag)
        if trailer and text.startswith(trailer, pos):
            pos += len(trailer)
        yield start, pos


def _line(regex: str, group: int = 0) -> Regex:
    return Regex(re.compile(regex, re.IGNORECASE | re.MULTILINE), group)


_MONTHS = "jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sept?(?:ember)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?"
_DAYS = "mon(?:day)?|tue(?:s|sday)?|wed(?:nesday)?|thu(?:rs|rsday)?|fri(?:day)?|sat(?:urday)?|sun(?:day)?"
# time zone abbreviations: a list, not any upper-case word ("... 2024-01-01 ABORT"
# is the user's word, and an edit of it must reach the model)
_ZONES = (
    "UTC|GMT|Z|UT|EST|EDT|CST|CDT|MST|MDT|PST|PDT|AKST|AKDT|HST|AST|ADT|NST|NDT|WET|WEST|CET"
    "|CEST|EET|EEST|MSK|BST|IST|PKT|ICT|WIB|SGT|HKT|JST|KST|AWST|ACST|ACDT|AEST|AEDT"
    "|NZST|NZDT|BRT|ART|CLT|COT|PET|SAST|WAT|CAT|EAT"
)
# an IANA zone by its region (Europe/Paris, America/Argentina/Salta): not any
# "word/word" ("release/v2" after a date is the user's branch, an edit of it must
# reach the model)
_IANA_ZONE = (
    r"(?:africa|america|antarctica|arctic|asia|atlantic|australia|europe|indian|pacific|etc"
    r"|us|canada|brazil|chile|mexico)"
    r"/[\w/+-]+"
)
# one word of a date or time: a number (2026-11-26, 10:42:01, 26th, +01:00, ...T10:42Z,
# 10h42, 10am; not "500mg"),
# a month or day name, AM/PM, a zone maybe with its offset (UTC, GMT+0100), an IANA
# zone, a linking word, or a parenthesised zone name ("(Central European Time)",
# replaced by \x00 before the words are checked)
_DATE_WORD = re.compile(
    r"[+-]?\d[\d:./-]*(?:t\d[\d:.]*)?(?:z|[+-]\d[\d:]*|st|nd|rd|th|h\d\d|[ap]\.?m\.?)?"
    r"|(?:" + _MONTHS + "|" + _DAYS + r")\.?|[ap]\.?m\.?"
    r"|(?-i:(?:" + _ZONES + r"))(?:[+-]\d{1,4}(?::?\d\d)?)?|" + _IANA_ZONE + "|at|of|the|on"
    r"|\x00",
    re.IGNORECASE,
)
# a word only a date or time has: a clock time, a date with separators (a year and a
# month, or day, month and year), a month or day name, an epoch count. A bare number,
# one with a single separator or an upper-case word alone is not one ("The dose
# today is 20", "... is 2.5", "The answer today is NO" are the user's own words)
_DATE_PROOF = re.compile(
    r"\d:\d\d|(?:19|20)\d\d[-/.](?:0?[1-9]|1[0-2])\b|\d\d?[-/.]\d\d?[-/.]\d\d|\d{8,}|\d[ \t]?[ap]\.?m\b|\d(?:st|nd|rd|th)\b|\d{1,2}h\d\d\b"
    r"|\b(?:" + _MONTHS + "|" + _DAYS + r")\b",
    re.IGNORECASE,
)
# a time zone's name in parentheses: "(Central European Standard Time)"; any other
# parenthesis is read word by word ("(Thursday)", "(UTC+01:00)"), so "(deploy to
# staging)" after a date is the user's words
_ZONE_NAME = re.compile(r"\((?-i:(?:[A-Z][a-z]+ ){1,4}Time)\)")
_DATE_GAP = re.compile(r"[ \t]*[,\u2013\u2014][ \t]*|[ \t]+")  # spaces, a comma or a dash
# a label opens a line (after a list marker, quote or heading), a sentence, or
# follows a closing ">" or "]" (a template tag: Mistral's [INST], [SYSTEM_PROMPT]),
# a "|", a bullet "•" or a ")" ("1) ", "[cron] "): "My flight today is at 10:30 pm"
# is the user's sentence, and an edit of its time, stepped over as a stale value,
# never reached the model. Linear: a run of markers is read only from its line's
# start, the blanks after a sentence or one of those characters only from their
# first position (no other start can reach them: one start per character)
_TIMESTAMP_LEAD = re.compile(
    r"(?:^[ \t>*#-]*|(?<=[.!?;:][ \t])[ \t]*|(?<=[>\]|•)])[ \t]*)"
    r"(?:the )?(?:current (?:date and time|date|time)|today's date|today is)"
    r"(?: in [\w ]{1,30}? format)?(?: is)?:?[ \t]*",
    re.IGNORECASE | re.MULTILINE,
)
MAX_TIMESTAMP = 80
# the template's end-of-turn tag closing a message's last line (<|im_end|>, </s>,
# <end_of_turn>, Mistral's [/INST]): a clock on a system prompt's last line shares
# its line with it
_END_OF_TURN = re.compile(r"(?:<[^\s<>]{1,40}>|\[/[A-Z_]{1,30}\])[ \t]*\Z")


def timestamps(text: str) -> Iterator[tuple[int, int]]:
    """Each date or time a "Current time is ..." style label gives, when the rest of
    its line is nothing but one (a short one): "What I need today is a script that
    ..." is the user's words, and reusing KV past an edit of them would hide the
    edit from the model. Each word is checked on its own (a pattern of alternating
    words backtracked exponentially on a line that was no date): linear, each
    line's end found once, at most ``MAX_TIMESTAMP`` characters checked per label."""
    line_end = -1  # the end of the line last looked at: each character read once
    for lead in _TIMESTAMP_LEAD.finditer(text):
        start = lead.end()
        if line_end < start:
            line_end = text.find("\n", start)
            line_end = len(text) if line_end < 0 else line_end
        if line_end - start > MAX_TIMESTAMP:
            continue
        value = text[start:line_end]
        value = value[: m.start()] if (m := _END_OF_TURN.search(value)) else value
        value = value.rstrip(" \t")
        bare = _ZONE_NAME.sub("\x00", value).replace("(", " ").replace(")", " ")
        words = _DATE_GAP.split(bare.strip(" \t"))
        if (
            value
            and all(_DATE_WORD.fullmatch(w.removesuffix(".") or ".") for w in words)
            and _DATE_PROOF.search(value)
        ):
            yield start, start + len(value)


# the keys of a channel envelope's "key: value" lines (Inbound Context): ids, names
# and types, never a key a user's words could follow ("message: delete the prod
# database", "to: ...", "date: ..." are read as the user wrote them)
_ENVELOPE_KEY = (
    r"(?:(?:chat|message|thread|user|account|group|conversation|session|sender|channel"
    r"|reply[ _-]?to)[ _-]?(?:id|type|name)|sender|channel|chat|provider|surface|platform"
    r"|username|timestamp|received[ _-]?at|id)"
)


RULES: tuple[VolatileRule, ...] = (
    # Claude Code's first system line: carries a per-request cch nonce
    VolatileRule(
        "billing_header", _line(r"^x-anthropic-billing-header:[^\n]*$"), Canonical.SENTINEL
    ),
    VolatileRule("cch_nonce", _line(r"\bcch=[0-9a-f]+;"), Canonical.SENTINEL),
    # "Current time is 10:42", "Current date: 2026-11-26", "Today's date is ..."
    VolatileRule("timestamp", timestamps, Canonical.SENTINEL),
    # Channel envelopes: "message_id = abc" opening a line; as a JSON key, the first
    # of an object opening a line or under a "{" line of its own (OpenClaw's
    # pretty-printed conversation info); "[message_id: 8812]", "| message_id: m-7",
    # "(message_id: 7)" opening a field; "chat_id=5 message_id=77" after another id's
    # pair. Not the user's SQL, code or logs: "WHERE message_id = 4411", "SET
    # message_id=4411", "delete_message(chat_id=5, message_id=4411)",
    # "json={'message_id': 4411}", "payload = {\n  'message_id': 4411", "msg=sent
    # message_id=4411"
    VolatileRule(
        "message_id",
        _line(
            r"(?:^[ \t#*>-]*message[_ ]id[ \t]*[:=]"
            r"|(?:^\{|(?<=\A\{\n)|(?<=\n\{\n))[ \t]*[\"']message[_ ]id[\"'][ \t]*:"
            r"|(?<=[\[|])[ \t]*message[_ ]id[\"']?[:=]|(?<=\()(?<!\w\()[ \t]*message[_ ]id:"
            r"|(?<![\w.:-])\w*id[:=][\w.:-]+[ \t]+message_id[:=])"
            r"[ \t]*[\"']?([\w.:-]+)[\"']?",
            group=1,
        ),
        Canonical.SENTINEL,
    ),
    # OpenClaw's per-message metadata block: a header line ("Inbound Context", as
    # written), then a fenced JSON block (a fence of code is the user's) or "key:
    # value" lines of envelope keys (not any line up to a blank one,
    # nor any "word: text" line: in "Inbound Context\nchat: 5\nTask: delete the prod
    # database" the task is the user's words). Linear as a regex: a header always
    # matches (the unfenced branch may take no line), so its fence scan lies inside
    # its match unless the fence is never closed, which can happen once per text;
    # a key line's leading blanks are read by one quantifier, then a fixed word.
    VolatileRule(
        "inbound_context",
        Regex(
            re.compile(
                r"^[#* \t]*(?-i:Inbound Context)\b[^\n]*\n"
                r"(?:[ \t]*```(?:json\w*)?[ \t]*\n\s*[{\[].*?```[^\n]*(?:\n|$)"
                r"|(?:[ \t]*(?:[-*][ \t]*)?" + _ENVELOPE_KEY + r"[ \t]*:[^\n]*(?:\n|$))*)",
                re.IGNORECASE | re.MULTILINE | re.DOTALL,
            )
        ),
        Canonical.DROP,
    ),
    # sub-agent completion announcements: "Stats: runtime 42s • tokens 1.2k ..."
    VolatileRule("subagent_stats", _line(r"^[ \t]*Stats: runtime\b[^\n]*(?:\n|$)"), Canonical.DROP),
    # an agent's reminders: dropped from the key (a turn without one still finds
    # the KV of a turn with one), but a changed reminder is read, never stepped over
    VolatileRule(
        "system_reminder",
        Block("<system-reminder>", "</system-reminder>", "\n"),
        Canonical.DROP,
        stale_ok=False,
    ),
)

VOLATILE_ROLES = frozenset({"system", "developer", "user"})
RULE_INDEX = {rule.name: i for i, rule in enumerate(RULES)}


@dataclass(frozen=True)
class CharSpan:
    """A volatile character range ``[start, end)`` of some text and the rule that found it."""

    start: int
    end: int
    rule: int  # index into RULES


def find_in_text(
    text: str, offset: int = 0, rules: Sequence[VolatileRule] = RULES
) -> list[CharSpan]:
    """Volatile spans of one message's text, merged where rules overlap."""
    found: list[CharSpan] = []
    for rule in rules:
        for start, end in rule.find(text):
            if end > start:
                found.append(CharSpan(offset + start, offset + end, RULE_INDEX[rule.name]))
    return merge_spans(found)


def merge_spans(spans: Iterable[CharSpan]) -> list[CharSpan]:
    """Union of overlapping spans, named by the earliest-starting rule unless the
    other's is stricter (``stricter``)."""
    merged: list[CharSpan] = []
    for span in sorted(spans, key=lambda s: (s.start, -s.end)):
        if merged and span.start < merged[-1].end:
            last = merged[-1]
            merged[-1] = CharSpan(
                last.start, max(last.end, span.end), stricter(last.rule, span.rule)
            )
        else:
            merged.append(span)
    return merged


def stricter(first: int, second: int) -> int:
    """The rule that names two joined spans: one whose changes must be read (a
    reminder) over one whose stale values may stand (an envelope), else the first.
    A reminder joined to the envelope before it was stepped over when it changed."""
    if RULES[first].stale_ok and not RULES[second].stale_ok:
        return second
    return first


def relocate_volatile_lines(
    contents: list[str | None], roles: list[str], fixed: str | None = None
) -> list[str | None]:
    """``--volatile-policy relocate``: move every line holding a volatile span out
    of system/user messages to the end of the last of them, so the prefix stays
    stable and the model still reads every current value. Not into a later tool
    result or assistant prefill: a moved timestamp would corrupt a JSON prefill and
    read as the tool's output. Lines holding ``fixed``
    (a vision model's image placeholder) stay: images are matched to placeholders
    in the order the client sent them, and a moved one would get another's pixels."""
    moved: list[str] = []
    out: list[str | None] = []
    last = max((i for i, role in enumerate(roles) if role in VOLATILE_ROLES), default=-1)
    for i, (content, role) in enumerate(zip(contents, roles)):
        if not content or role not in VOLATILE_ROLES or i >= last:  # the last one is the end
            out.append(content)
            continue
        spans = find_in_text(content)
        if not spans:
            out.append(content)
            continue
        keep_from = 0  # text before it is in ``kept`` or ``moved``
        done = 0  # lines before it are decided: moved, or staying
        staying = False  # the last decided lines stay
        kept: list[str] = []
        for span in spans:
            if span.end <= done:  # wholly on lines already decided
                continue
            if span.start < done:  # starts on a decided line and runs past it
                line_start = done
            else:
                # scans bounded by what is already done: each character examined at
                # most twice however many spans share a line
                newline = content.rfind("\n", done, span.start)
                line_start = done if newline < 0 else newline + 1
            line_end = content.find("\n", max(span.end - 1, line_start))
            line_end = len(content) if line_end < 0 else line_end + 1
            if (span.start < done and staying) or (
                fixed and content.find(fixed, line_start, line_end) >= 0
            ):
                done, staying = line_end, True  # stays where it is, its value with it
                continue
            kept.append(content[keep_from:line_start])
            moved.append(content[line_start:line_end].rstrip("\n"))
            keep_from = done = line_end
            staying = False
        kept.append(content[keep_from:])
        out.append("".join(kept))
    if moved:
        final = out[last] or ""
        out[last] = final + ("\n\n" if final else "") + "\n".join(m for m in moved if m)
    return out


@dataclass(frozen=True)
class MessageSlice:
    """Where one message sits in the rendered prompt text."""

    start: int
    end: int
    role: str


def prompt_spans(text: str, messages: Sequence[MessageSlice]) -> list[CharSpan]:
    """Volatile spans of a rendered prompt, found message by message."""
    spans: list[CharSpan] = []
    for m in messages:
        if m.role in VOLATILE_ROLES:
            spans.extend(find_in_text(text[m.start : m.end], offset=m.start))
    return spans


def canonical_text(
    text: str, spans: Sequence[CharSpan], start: int = 0, end: int | None = None
) -> str:
    """``text[start:end]`` with each volatile span replaced by its canonical form."""
    end = len(text) if end is None else end
    out: list[str] = []
    pos = start
    for span in spans:
        if span.end <= start or span.start >= end:
            continue
        out.append(text[pos : span.start])
        if RULES[span.rule].canonical is Canonical.SENTINEL:
            out.append(f"\x00{RULES[span.rule].name}\x00")
        pos = span.end
    out.append(text[pos:end])
    return "".join(out)
