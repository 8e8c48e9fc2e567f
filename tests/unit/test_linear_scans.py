"""Scans of client text are linear in its length. Shown by counting the characters
``str.find`` examines, not by timing: the block scans (system reminders, think
blocks) run on ``str.find`` alone, and their total must stay within one pass.
The regex rules cannot be counted this way; each is linear by construction (see
``kvcache.volatile_rules``)."""

from __future__ import annotations

from operator import index
from typing import SupportsIndex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.healing import visible_form
from kvcache.volatile_rules import find_in_text, relocate_volatile_lines

N = 200_000


class CountingText(str):
    """A str that tallies the characters its ``find`` and ``rfind`` calls examine."""

    examined: int

    def __new__(cls, value: str) -> CountingText:
        self = super().__new__(cls, value)
        self.examined = 0
        return self

    def _bounds(self, start: SupportsIndex | None, end: SupportsIndex | None) -> tuple[int, int]:
        return (0 if start is None else index(start)), (len(self) if end is None else index(end))

    def find(self, sub: str, start: SupportsIndex | None = None, end=None, /) -> int:
        found = super().find(sub, start, end)
        lo, hi = self._bounds(start, end)
        self.examined += (found + len(sub) if found >= 0 else hi) - lo  # forwards from lo
        return found

    def rfind(self, sub: str, start: SupportsIndex | None = None, end=None, /) -> int:
        found = super().rfind(sub, start, end)
        lo, hi = self._bounds(start, end)
        self.examined += hi - (found if found >= 0 else lo)  # backwards from hi
        return found


def adversarial(unit: str) -> CountingText:
    return CountingText(unit * (N // len(unit)))


@pytest.mark.parametrize(
    "unit",
    [
        "<system-reminder>",  # no closing tag: a lazy regex rescans the tail per opening
        "<system-reminder></system-reminder",
        "<system-reminder></system-reminder>\n",
        "</system-reminder><system-reminder>",
        "<system-reminder>\n" + " " * 40,
    ],
)
def test_find_in_text_examines_each_character_once(unit: str) -> None:
    text = adversarial(unit)
    find_in_text(text)
    assert 0 < text.examined <= len(text)


@pytest.mark.parametrize(
    "unit", ["<think>", "<think></think", "<think></think>", "</think><think>", "<think> \n"]
)
def test_visible_form_examines_each_character_once(unit: str) -> None:
    text = adversarial(unit)
    visible_form(text)
    assert 0 < text.examined <= len(text)


_FRAGMENTS = (
    "<system-reminder>",
    "</system-reminder>",
    "<think>",
    "</think>",
    "<",
    "</",
    ">",
    "\n",
    " ",
    "x",
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=60).map("".join))
def test_block_scans_stay_within_one_pass(text: str) -> None:
    for scan in (find_in_text, visible_form):
        counted = CountingText(text)
        scan(counted)
        assert counted.examined <= len(text)


@pytest.mark.parametrize(
    "unit", ["cch=1;", "cch=1;\n", "Be brief. Current time: 2026-11-27 05:00:00 "]
)
def test_relocating_volatile_lines_examines_each_character_at_most_three_times(
    unit: str,
) -> None:
    """Many volatile spans on one long line: each span used to look for its line's
    bounds from the start of the text (quadratic). Now: one pass to find the
    spans, and each character at most twice for the lines' bounds."""
    text = adversarial(unit)
    assert find_in_text(text)
    text.examined = 0
    out = relocate_volatile_lines([text, "now"], ["user", "user"])
    assert out[0] != text  # lines were moved
    assert 0 < text.examined <= 3 * len(text)


@pytest.mark.parametrize("unit", ["cch=1; <image> ", "cch=1; <image>\n", "cch=1;\n<image> cch=2;"])
def test_relocating_around_image_placeholders_stays_linear(unit: str) -> None:
    """Lines holding an image placeholder stay where they are; deciding so must
    not rescan them for every volatile span they hold."""
    text = adversarial(unit)
    out = relocate_volatile_lines([text, "now"], ["user", "user"], fixed="<image>")
    assert out[0].count("<image>") == text.count("<image>")  # every image stays
    assert 0 < text.examined <= 4 * len(text)


@pytest.mark.parametrize(
    "unit",
    [
        "<arg_key>a</arg_key><arg_value>x",  # values left open
        "<arg_key>a</arg_key>x",  # keys with no value
        "<arg_key>a",  # keys left open
        "<arg_key>a</arg_key> \n<arg_value>x</arg_value>",
    ],
)
def test_glm_pairs_examine_each_character_at_most_twice(unit: str) -> None:
    from app.protocol.tool_formats import _glm_pairs

    text = adversarial(unit)
    try:
        _glm_pairs(text)
    except ValueError:  # an argument left open: no call (stops at the first)
        assert unit != "<arg_key>a</arg_key> \n<arg_value>x</arg_value>"
    assert text.examined <= 2 * len(text)
