"""What `kvwarm chat` reads at its prompt: one line, or a message of several lines.

A line that is `\"\"\"` opens a block that the next such line closes: the lines
between are one message, kept as typed (a pasted snippet keeps its indentation,
and a `/word` in it is text, not a command). A line ending in a backslash goes
on to the next line (the backslash dropped, the line break kept).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PROMPT = "> "
MORE = "... "  # the prompt inside a block or after a backslash
BLOCK = '"""'


@dataclass(frozen=True)
class Typed:
    text: str
    one_line: bool  # a plain line, which may be a /command; a block or a continued line never is


def read_typed(read: Callable[[str], str]) -> Typed:
    """The next message; ``read(prompt)`` reads a line as ``input`` does, and its
    EOFError (Ctrl-D) or KeyboardInterrupt (Ctrl-C) drop the lines read so far."""
    line = read(PROMPT)
    # trailing blanks are invisible; an indented `\"\"\"` (a docstring) is text
    if line.rstrip() == BLOCK:
        lines: list[str] = []
        while (line := read(MORE)).rstrip() != BLOCK:
            lines.append(line)
        return Typed("\n".join(lines).rstrip("\n"), one_line=False)
    if not line.endswith("\\"):
        return Typed(line, one_line=True)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read(MORE)
    return Typed("\n".join([*lines, line]), one_line=False)
