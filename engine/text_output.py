"""Per-request token -> text: mlx-lm's streaming detokenizer plus stop strings."""

from __future__ import annotations

from typing import Any

from engine.reasoning_gate import ReasoningGate
from engine.stop_matcher import StopMatcher
from scheduler.request import ReasoningTags


class TextOutput:
    """Turns one request's generated tokens into safe-to-stream text deltas.

    The streaming detokenizer holds back incomplete UTF-8 sequences, so a
    multi-byte character is never split across deltas; the stop matcher holds
    back anything that may begin a stop string. ``reasoning``: a chat reply's
    think tags, whose block stop strings do not match (engine.reasoning_gate).
    """

    def __init__(
        self,
        detokenizer: Any,
        stops: tuple[str, ...],
        trim_leading_space: bool = True,
        reasoning: ReasoningTags | None = None,
    ):
        self._detok = detokenizer
        self._stop = StopMatcher(stops)
        # with no stops there is nothing to keep from the reasoning (nor to hold)
        self._gate = ReasoningGate(reasoning) if reasoning and self._stop.stops else None
        # the table detokenizer's one-call form (engine.fast_detok): this runs per
        # row per step, on the host's critical path
        self._push = getattr(detokenizer, "push", None)
        if not trim_leading_space:
            _keep_leading_space(detokenizer)

    @property
    def started(self) -> bool:
        """Whether a token has been added (EOS tokens never are)."""
        return bool(self._detok.tokens)

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    @property
    def matched_stop(self) -> str | None:
        return self._stop.matched

    def add_token(self, token: int) -> str:
        push = self._push
        if push is not None:
            text = push(token)
        else:
            self._detok.add_token(token)
            text = self._detok.last_segment
        if self._gate is None:
            return self._stop.feed(text)
        return self._gated(text)

    def finish(self) -> str:
        """Flush everything still held (call once, when generation ends)."""
        self._detok.finalize()
        text = self._detok.last_segment
        if self._gate is None:
            text = self._stop.feed(text)
        else:
            text = self._gated(text, final=True)
        return text + self._stop.flush()

    def _gated(self, text: str, final: bool = False) -> str:
        """Reasoning passes unmatched; the answer after it goes to the stop matcher."""
        gate = self._gate
        assert gate is not None
        if self._stop.stopped:
            return ""
        passed, matched = gate.feed(text)
        if final:
            matched += gate.finish()
        return passed + self._stop.feed(matched)


def _keep_leading_space(detokenizer: Any) -> None:
    """mlx-lm's streaming detokenisers drop the space before the first word (the
    way a chat reply should start); a completion continuing its prompt keeps it."""
    if hasattr(detokenizer, "trim_space"):  # SentencePiece
        detokenizer.trim_space = False
    if hasattr(detokenizer, "_maybe_trim_space"):  # byte-level BPE
        detokenizer._maybe_trim_space = lambda text: text
    if hasattr(detokenizer, "keep_leading_space"):  # a decoder that drops it (Metaspace)
        detokenizer.keep_leading_space()
