"""mlx-lm's byte-level BPE streaming detokenizer, minus its per-token decoding loop.

``BPEStreamingDetokenizer.add_token`` maps every character of the text held so
far back to its byte through a dict, in Python, for every token: at batch 64
on an accelerator that is most of the host time a step costs. The bytes of each
token never change, so they are computed once per tokenizer (a table shared by
every request) and a token then costs one concatenation and one UTF-8 decode.
The text produced is the same, character for character: the table is built by
mlx-lm's own per-character rule, and finalisation is mlx-lm's. Held tokens (an
incomplete character, a lone space) are decoded as they come (``HeldRun``),
not all again per token, and a long run of them streams.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Any, TypeVar

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
    _byte_decoder,
)

from engine.emitted_text import EmittedOutput, EmittedText
from engine.utf8_tail import complete_text
from engine.window_detok import WindowDetokenizer, token_bytes

D = TypeVar("D", "TableBPEDetokenizer", "PiecewiseSPMDetokenizer")

SPACE = 32
# tokens a run is held whole (as mlx-lm holds it) before its text streams as it comes
HOLD = 64


class TableBPEDetokenizer(EmittedOutput, BPEStreamingDetokenizer):
    """A BPEStreamingDetokenizer reading token bytes from a precomputed table.

    Text is kept as the pieces emitted (joined only when ``text`` is read) and
    each piece is handed out once by ``push``/``last_segment``: mlx-lm's
    ``self.text +=`` copies the whole reply on every token, which grows with
    the reply's length."""

    def __init__(
        self,
        template: BPEStreamingDetokenizer,
        table: list[bytes],
        lone: list[bool],
        exact: list[bool],
    ):
        self.__dict__.update(template.__dict__)  # tokenmap and settings, shared
        self._table = table
        self._lone_space = lone  # tokens that are a single space: held until the next
        self._finalize_same = exact  # tokens mlx-lm's finalize maps to their table bytes
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self.tokens = []
        self._run = HeldRun()  # held tokens (an incomplete character, a lone space)
        self._out = EmittedText()

    def _maybe_trim_space(self, current_text: str) -> str:
        if current_text[:1] == " " and not self._out:
            return current_text[1:]
        return current_text

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        if token < len(self._table):
            raw, lone = self._table[token], self._lone_space[token]
        else:  # mlx-lm's fallback for ids past the vocabulary (a padded head)
            raw, lone = b"!", False
        run = self._run
        if not run.tokens:  # nothing held: the common case, one decode
            text = raw.decode("utf-8", "replace")
            if not lone and not text.endswith("\ufffd"):
                self._out.emit(self._maybe_trim_space(text) if not self._out else text)
                return
        run.add(token, raw, token >= len(self._table) or self._finalize_same[token])
        if not lone and not run.unfinished:
            self._emit_run(run.take())
            run.clear()
        elif run.streams:
            self._emit_run(run.take())

    def _emit_run(self, text: str) -> None:
        """The held run's text so far; mlx-lm trims the first character of a run
        flushed while nothing was emitted (only its first: one run may now be
        emitted in several pieces)."""
        if text and not self._run.emitted:
            self._run.emitted = True
            text = self._maybe_trim_space(text)
        self._out.emit(text)

    def finalize(self) -> None:
        run = self._run
        if run.streams:  # its tokens so far finalize to their table bytes (HeldRun.add)
            self._emit_run(run.take() + complete_text(run.pending))
        else:  # mlx-lm's finalize (its strict byte map), but for a character cut at the end
            decoder = _byte_decoder()
            held = "".join(self.tokenmap[t] if t < len(self._table) else "!" for t in run.ids)
            current = complete_text(bytes(decoder[c] for c in held))
            self._out.emit(self._maybe_trim_space(current))
        run.clear()


class PiecewiseSPMDetokenizer(EmittedOutput, SPMStreamingDetokenizer):
    """mlx-lm's SentencePiece detokenizer, its text kept as the pieces emitted
    (engine.emitted_text): its ``self.text += text`` copied the whole reply on
    every token. Its output is mlx-lm's, segment for segment, but for a run held
    past ``HOLD`` tokens, which streams (its text the same)."""

    def __init__(self, template: SPMStreamingDetokenizer):
        self.__dict__.update(template.__dict__)  # tokenmap and trim_space, shared
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self.tokens = []
        self._run = HeldRun()  # held tokens: their text ends in U+FFFD
        self._out = EmittedText()

    def add_token(self, token: int) -> None:
        # mlx-lm's, but held bytes are decoded as they come (HeldRun), not joined
        # and decoded again per token
        self.tokens.append(token)
        run, raw = self._run, self.tokenmap[token]
        if not run.tokens:  # nothing held: the common case, one decode
            text = raw.decode("utf-8", "replace")
            if not text.endswith("\ufffd"):
                self._emit_run(text)
                run.emitted = False  # the next run's first character is its own
                return
        run.add(token, raw, True)
        if not run.unfinished or run.streams:
            self._emit_run(run.take())
        if not run.unfinished:
            run.clear()

    def _emit_run(self, text: str) -> None:
        # mlx-lm's bytes.replace(sep, b" ") before decoding: the same text, as the
        # separator's bytes (a lead byte, then two continuations) always decode to it
        text = text.replace("\u2581", " ")
        if text and not self._run.emitted:
            self._run.emitted = True
            if not self._out and self.trim_space and text[:1] == " ":
                text = text[1:]
        self._out.emit(text)

    def finalize(self) -> None:
        run = self._run
        self._emit_run(run.take() + complete_text(run.pending))
        run.clear()


class HeldRun:
    """Tokens held since the detokenizer last emitted, their text decoded as they
    come: only an incomplete character's bytes (at most 3) wait undecoded.
    mlx-lm's detokenizers joined the held bytes and decoded them all again per
    token, quadratic over a run of real U+FFFDs (a model echoing mojibake) or
    invalid bytes, and streamed nothing until it ended. Decoding in steps gives
    the text decoding the run whole does (Python's incremental UTF-8 decoder)."""

    __slots__ = ("emitted", "ids", "pending", "streams", "tokens", "_exact", "_last", "_pieces")

    def __init__(self) -> None:
        self.ids: list[int] = []  # the run's tokens, for mlx-lm's BPE finalize (unless streamed)
        self._pieces: list[str] = []  # decoded, not yet emitted
        self.clear()

    def clear(self) -> None:
        self.ids.clear()
        self._pieces.clear()
        self.tokens = 0
        self.pending = b""  # an incomplete character's bytes so far
        self.emitted = False  # some of the run's text was emitted (its first character seen)
        self.streams = False  # the run is long: emit its text as it comes
        self._last = ""  # the run's last decoded character
        self._exact = True  # every token finalizes to the bytes it decodes here

    def add(self, token: int, raw: bytes, exact: bool) -> None:
        data = self.pending + raw if self.pending else raw
        text, used = codecs.utf_8_decode(data, "replace", False)
        self.pending = data[used:]
        if text:
            self._pieces.append(text)
            self._last = text[-1]
        self.tokens += 1
        self._exact = self._exact and exact
        # a short run is held whole, as mlx-lm holds it (its segments, exactly),
        # and one whose BPE finalize would decode other bytes (its strict byte map)
        if not self.streams and self.tokens > HOLD and self._exact:
            self.streams = True  # for good: its text so far is emitted
            self.ids.clear()  # never read again: finalize emits what is decoded
        if not self.streams:
            self.ids.append(token)

    @property
    def unfinished(self) -> bool:
        """Whether the run's text ends in U+FFFD (mlx-lm's test for holding on):
        an incomplete character waits, or the last one decoded is U+FFFD."""
        return bool(self.pending) or self._last == "\ufffd"

    def take(self) -> str:
        text = "".join(self._pieces)
        self._pieces.clear()
        return text


def bpe_token_bytes(token: str) -> bytes:
    """mlx-lm's ``_decode_bytes`` for one token, kept exact (its falsy-0 quirk included)."""
    decoder = _byte_decoder()
    out = bytearray()
    for c in token:
        res = decoder.get(c, False)
        if res:
            out.append(res)
        else:
            out.extend(c.encode("utf-8"))
    return bytes(out)


def strict_bpe_bytes(token: str) -> bytes | None:
    """A byte-level BPE token's bytes when every character is in the byte map;
    None when one is not (its text is not a byte encoding)."""
    decoder = _byte_decoder()
    if all(c in decoder for c in token):
        return bytes(decoder[c] for c in token)
    return None


def detokenizer_factory(tokenizer: Any) -> Callable[[], Any]:
    """A maker of fresh streaming detokenizers for ``tokenizer`` (mlx-lm's
    TokenizerWrapper): the table-driven one for byte-level BPE, a windowed one
    where mlx-lm's would decode each whole line per token (engine.window_detok),
    mlx-lm's for SentencePiece with its text held in pieces."""
    template = tokenizer.detokenizer
    if type(template) is NaiveStreamingDetokenizer:
        hf, clean = template._tokenizer, template._clean_spaces  # noqa: SLF001 - its probe
        read = token_bytes(hf)  # built once per tokenizer
        return lambda: WindowDetokenizer(hf, clean, read)
    if type(template) is SPMStreamingDetokenizer:
        return _copies(PiecewiseSPMDetokenizer(template))
    if type(template) is not BPEStreamingDetokenizer:
        return lambda: tokenizer.detokenizer
    decoder = _byte_decoder()
    tokens = [t if isinstance(t, str) else "" for t in template.tokenmap]
    table = [bpe_token_bytes(t) for t in tokens]
    lone = [len(t) == 1 and decoder.get(t) == SPACE for t in tokens]
    exact = [
        isinstance(t, str) and strict_bpe_bytes(t) == b
        for t, b in zip(template.tokenmap, table, strict=True)
    ]
    return _copies(TableBPEDetokenizer(template, table, lone, exact))


def _copies(proto: D) -> Callable[[], D]:
    """Fresh detokenizers sharing ``proto``'s tables (built once per tokenizer)."""

    def make() -> D:
        fresh = type(proto).__new__(type(proto))
        fresh.__dict__.update(proto.__dict__)
        fresh.reset()
        return fresh

    return make
