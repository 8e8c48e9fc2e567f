"""Whether a tool call's markup is inside an argument value at the point read so far.

A closing tag met inside a value is that value's text (a model writing a file
that mentions ``</tool_call>``), not the end of the call: closing there cut the
call in two, it did not parse, and the whole call went out as plain content.
Fed the call's text in pieces, in one pass: linear however it is split.
"""

from __future__ import annotations

import re

# values of tag markup and what ends each: Qwen XML parameters (their function's
# end too: models leave out </parameter>, which Qwen's parsers allow), GLM
# argument values, Gemma 4 strings
_VALUE_TAGS = {
    "<parameter=": ("</parameter>", "</function>"),
    "<arg_value>": ("</arg_value>",),
    '<|"|>': ('<|"|>',),
}
_OPENERS = re.compile("|".join(re.escape(t) for t in _VALUE_TAGS))
_CLOSERS = {
    opener: re.compile("|".join(re.escape(t) for t in ends)) for opener, ends in _VALUE_TAGS.items()
}
_LONGEST = max(len(t) for opener, ends in _VALUE_TAGS.items() for t in (opener, *ends))
_IN_JSON_STRING = re.compile(r'["\\]')


class OpenValue:
    """Fed a call's text; ``open`` while it is inside a JSON string (Hermes JSON
    calls) or a value tag not yet closed (tag markup)."""

    def __init__(self) -> None:
        self._json: bool | None = None  # decided by the call's first non-space character
        self._in_string = False
        self._escaped = False  # a JSON string's backslash ended the last piece
        self._closer: re.Pattern[str] | None = None  # what closes the value open now
        self._tail = ""  # where a tag split across pieces may begin

    @property
    def open(self) -> bool:
        return self._in_string if self._json else self._closer is not None

    def feed(self, text: str) -> None:
        if self._json is None:
            start = text.lstrip()
            if not start:
                return
            self._json = start[0] == "{"
        if self._json:
            self._feed_json(text)
        else:
            self._feed_tags(text)

    def _feed_json(self, text: str) -> None:
        i = 0
        if self._escaped and text:
            self._escaped, i = False, 1
        while i < len(text):
            if not self._in_string:
                i = text.find('"', i)
                if i < 0:
                    return
                self._in_string, i = True, i + 1
                continue
            found = _IN_JSON_STRING.search(text, i)
            if found is None:
                return
            if found.group() == '"':
                self._in_string, i = False, found.end()
            elif found.end() < len(text):
                i = found.end() + 1  # the escaped character, whatever it is
            else:
                self._escaped, i = True, len(text)

    def _feed_tags(self, text: str) -> None:
        window = self._tail + text
        pos = 0
        while True:
            if self._closer is None:
                found = _OPENERS.search(window, pos)
                if found is None:
                    break
                self._closer, pos = _CLOSERS[found.group()], found.end()
            else:
                end = self._closer.search(window, pos)
                if end is None:
                    break
                pos, self._closer = end.end(), None
        self._tail = window[max(pos, len(window) - _LONGEST + 1) :]
