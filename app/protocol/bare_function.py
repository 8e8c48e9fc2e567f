"""Whether the text after a bare Qwen ``<function=`` can still be a call.

Qwen3-Coder and Qwen3.5 often write a call without its opening ``<tool_call>``
(``QWEN_FUNCTION``), so ``<function=`` opens a call for that family. Prose that
quotes the markup ("use `<function=f>` to call") must not open a call running
to some later ``</function>``: that withheld the rest of the reply and, when a
real call followed, took it down with the mention. ``BareFunction`` reads what
follows the opening as it streams and says at the first character that no call
can hold. A call's shape: one of the request's tool names, optional spaces,
``>``, then only spaces and ``<parameter=...</parameter>`` blocks up to
``</function>``. Each piece is read once, in one pass.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable

PARAMETER, PARAMETER_END, CLOSE = "<parameter=", "</parameter>", "</function>"
_BODY_TAGS = (PARAMETER, CLOSE)
_LONGEST_TAG = max(map(len, _BODY_TAGS))
_NAME = re.compile(r"[^\s<>]*")
_SPACES = re.compile(r"\s*")


def _end(pattern: re.Pattern[str], text: str, at: int, upto: int) -> int:
    """Where ``pattern``, which matches the empty string too, ends from ``at``."""
    found = pattern.match(text, at, upto)
    assert found is not None
    return found.end()


class BareFunction:
    """Fed the text after ``<function=`` in pieces (``feed``)."""

    def __init__(self, names: Iterable[str]) -> None:
        self._names = sorted(names)  # sorted: a prefix is checked by bisection
        self._known = frozenset(self._names)
        self._longest = max(map(len, self._names), default=0)
        self._state = "name"
        self._name = ""
        self._tag = ""  # the start of a body tag, split across pieces
        self._tail = ""  # in a value: where a split </parameter> may begin
        self._read = 0  # characters read before the current piece
        self._mark = 0  # where the body's tag being read began
        self.failed = False
        # once failed: how much of the text had a call's shape (its name, its whole
        # parameters); a bare <function= in there is no call when it is read again
        self.quiet = 0

    def feed(self, text: str) -> int | None:
        """None: all of ``text`` read, a call's start so far. Else where reading
        ``text`` stopped: past the call's ``</function>``, or, ``failed``, at a
        character no call holds (what follows it is not read)."""
        i, end = 0, len(text)
        while i < end:
            if self._state == "name":
                # no name is longer than the longest tool's: a long word is not read on
                stop = _end(_NAME, text, i, min(end, i + self._longest + 1 - len(self._name)))
                self._name += text[i:stop]
                if not self._could_name(self._name):
                    return self._fail(i, 0)
                if stop == end:
                    break
                if self._name not in self._known or text[stop] == "<":
                    return self._fail(stop, 0)
                self._state = "body" if text[stop] == ">" else "spaces"
                i = stop + 1
            elif self._state == "spaces":  # between the name and its '>'
                i = _end(_SPACES, text, i, end)
                if i == end:
                    break
                if text[i] != ">":
                    return self._fail(i, 0)
                self._state, i = "body", i + 1
            elif self._state == "body":
                if not self._tag:
                    i = _end(_SPACES, text, i, end)
                    if i == end:
                        break
                    self._mark = self._read + i
                piece = text[i : i + _LONGEST_TAG - len(self._tag)]
                seen = self._tag + piece
                tag = next((t for t in _BODY_TAGS if t.startswith(seen[: len(t)])), None)
                if tag is None:
                    return self._fail(i, self._mark)
                if len(seen) < len(tag):  # the piece ends inside the tag
                    self._tag = seen
                    break
                i += len(tag) - len(self._tag)
                self._tag = ""
                if tag == CLOSE:
                    self._state = "closed"
                    return i
                self._state = "value"
            else:  # a parameter's name and value, up to its </parameter>
                window = self._tail + text[i:]
                found = window.find(PARAMETER_END)
                if found < 0:
                    self._tail = window[max(0, len(window) - len(PARAMETER_END) + 1) :]
                    break
                i += found + len(PARAMETER_END) - len(self._tail)
                self._tail, self._state = "", "body"
        self._read += end
        return None

    def _could_name(self, name: str) -> bool:
        """Whether ``name`` begins one of the tools' names."""
        if len(name) > self._longest:
            return False
        at = bisect.bisect_left(self._names, name)
        return at < len(self._names) and self._names[at].startswith(name)

    def _fail(self, at: int, quiet: int) -> int:
        self.failed, self.quiet = True, quiet
        return at
