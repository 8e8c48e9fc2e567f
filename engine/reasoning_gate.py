"""Which generated text stop strings may match: the answer, not the reasoning.

A thinking model restates the question while it thinks ("Question:", blank
lines): a client's stop string matched there ended the reply inside its think
block, with no answer at all. Only a chat reply whose output is parsed for
reasoning (``scheduler.request.ReasoningTags``) is gated; the block is found
exactly as ``app.protocol.output_parser`` finds it: opened by the prompt, or
by the think tag the reply starts with (whitespace before it aside), and
closed by the first end tag. The whitespace after the end tag is no part of
the answer either (the parser drops it): a ``"\\n\\n"`` stop matched there
would end every thinking reply before its answer. Pure Python, linear, and
the same for any chunking (tags split across pieces included).
"""

from __future__ import annotations

import enum

from scheduler.request import ReasoningTags


class _Mode(enum.Enum):
    BOUNDARY = "boundary"  # the reply's start: a think tag may still open a block
    REASONING = "reasoning"
    AFTER = "after"  # the end tag passed: whitespace before the answer
    ANSWER = "answer"


class ReasoningGate:
    """Feed decoded text; get back what passes unmatched (reasoning, its tags and
    the whitespace around them) and what follows it for the stop matcher."""

    def __init__(self, tags: ReasoningTags):
        self._start, self._end = tags.start, tags.end
        self._mode = _Mode.REASONING if tags.opened else _Mode.BOUNDARY
        # the reply's start, held until it is known to open a block or not:
        # whitespace (in pieces: a model looping on blank lines) and what may be
        # the start of the think tag
        self._ws: list[str] = []
        self._lead = ""
        self._tail = ""  # the end of the reasoning an end tag may have begun in

    def feed(self, text: str) -> tuple[str, str]:
        mode = self._mode
        if mode is _Mode.ANSWER:
            return "", text
        if mode is _Mode.BOUNDARY:
            return self._boundary(text)
        if mode is _Mode.REASONING:
            return self._reasoning(text)
        return self._after(text)

    def finish(self) -> str:
        """What is still held at the end: a start that opened no block, the answer's."""
        held = "".join(self._ws) + self._lead
        self._ws.clear()
        self._lead = ""
        return held

    def _boundary(self, text: str) -> tuple[str, str]:
        if not self._lead:
            stripped = text.lstrip()
            if len(stripped) < len(text):
                self._ws.append(text[: len(text) - len(stripped)])
            text = stripped
            if not text:
                return "", ""
        lead = self._lead + text
        if lead.startswith(self._start):
            self._lead = ""
            passed = self.finish() + self._start
            self._mode = _Mode.REASONING
            more, matched = self._reasoning(lead[len(self._start) :])
            return passed + more, matched
        if self._start.startswith(lead):
            self._lead = lead  # could still become the tag
            return "", ""
        self._mode = _Mode.ANSWER
        return "", self.finish() + text

    def _reasoning(self, text: str) -> tuple[str, str]:
        # search only what is new, plus the tail the end tag may begin in
        window = self._tail + text
        i = window.find(self._end)
        if i < 0:
            keep = len(self._end) - 1
            self._tail = window[-keep:] if keep else ""
            return text, ""
        cut = i + len(self._end) - len(self._tail)  # the end tag's end, in ``text``
        self._tail = ""
        self._mode = _Mode.AFTER
        more, matched = self._after(text[cut:])
        return text[:cut] + more, matched

    def _after(self, text: str) -> tuple[str, str]:
        stripped = text.lstrip()
        if not stripped:
            return text, ""
        self._mode = _Mode.ANSWER
        return text[: len(text) - len(stripped)], stripped
