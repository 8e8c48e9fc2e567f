"""Token log probabilities in OpenAI's two wire shapes: chat's ``logprobs.content``
list and legacy completions' parallel arrays (tokens, token_logprobs,
top_logprobs, text_offset)."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator
from typing import Any

from scheduler.request import TokenChoice, TokenLogprob

# what OpenAI reports for a token the processors ruled out (-inf is not JSON)
FLOOR = -9999.0
# the most tokens' entries one streamed frame carries: 2,000 tokens with 20
# alternatives took 88 ms to build into one frame (2.5 MB), on the event loop
FRAME_LOGPROBS = 256


def _value(choice: TokenChoice) -> float:
    value = choice.logprob
    return value if value >= FLOOR else FLOOR  # NaN too: JSON cannot carry it


def _text(choice: TokenChoice) -> str:
    # a token inside a UTF-8 character has no text of its own: its bytes say it
    return choice.piece.decode("utf-8", "replace")


def _chat_choice(choice: TokenChoice) -> dict[str, Any]:
    return {"token": _text(choice), "logprob": _value(choice), "bytes": list(choice.piece)}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: one item per generated token."""
    return {
        "content": [
            {**_chat_choice(e.chosen), "top_logprobs": [_chat_choice(t) for t in e.top]}
            for e in entries
        ]
    }


def _key(choice: TokenChoice) -> str:
    """A token as legacy completions name it: its text, or OpenAI's ``bytes:`` form
    (backslash-x escapes) for a token inside a UTF-8 character: as text, all of
    those would be one replacement-character key of ``top_logprobs``."""
    try:
        return choice.piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in choice.piece)


class CompletionLogprobs:
    """Legacy completions' arrays, built a token at a time: ``text_offset`` is each
    token's character offset in the choice's text, counting a character once it is
    complete; ``top_logprobs`` holds the alternatives and the chosen token (up to
    ``logprobs`` + 1 entries, as OpenAI's)."""

    def __init__(self) -> None:
        self._offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def _broken_before(self, piece: bytes) -> int:
        """Replacement characters an unfinished character becomes when this token
        does not continue it: they come before the token's own text."""
        pending = self._decoder.getstate()[0]
        if not pending or not piece or 0x80 <= piece[0] <= 0xBF:
            return 0
        return len(pending.decode("utf-8", "replace"))

    def take(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for e in entries:
            tokens.append(_key(e.chosen))
            values.append(_value(e.chosen))
            top: dict[str, float] = {}
            for t in (*e.top, e.chosen):  # most likely first: a repeated key keeps it
                top.setdefault(_key(t), _value(t))
            tops.append(top)
            offsets.append(self._offset + self._broken_before(e.chosen.piece))
            self._offset += len(self._decoder.decode(e.chosen.piece))
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def logprob_frames(
    entries: list[TokenLogprob], build: Callable[[list[TokenLogprob], bool], str]
) -> str | Iterator[str]:
    """A stream's frame for an event and the ``entries`` of the tokens since the
    last frame: ``build(entries, True)``. A longer run than ``FRAME_LOGPROBS`` (text
    the parser withheld, a tool call until its end tag, reasoning dropped) comes
    as frames built one at a time (``app.sse.framed`` sends each in an event-loop
    turn of its own): its earlier entries by ``build(group, False)``, a frame with
    no text (OpenAI streams logprobs per token), the event's frame last."""
    if len(entries) <= FRAME_LOGPROBS:
        return build(entries, True)
    return _split_frames(entries, build)


def _split_frames(
    entries: list[TokenLogprob], build: Callable[[list[TokenLogprob], bool], str]
) -> Iterator[str]:
    last = (len(entries) - 1) // FRAME_LOGPROBS * FRAME_LOGPROBS  # the event's own group
    for start in range(0, len(entries), FRAME_LOGPROBS):
        yield build(entries[start : start + FRAME_LOGPROBS], start == last)
