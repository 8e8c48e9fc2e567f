"""mlx-lm's byte-level BPE streaming detokenizer, minus its per-token decoding loop.

``BPEStreamingDetokenizer.add_token`` maps every character of the text held so
far back to its byte through a dict, in Python, for every token: at batch 64
on an accelerator that is most of the host time a step costs. The bytes of each
token never change, so they are computed once per tokenizer (a table shared by
every request) and a token then costs one concatenation and one UTF-8 decode.
The text produced is the same, character for character: the table is built by
mlx-lm's own per-character rule, and finalisation is mlx-lm's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
    _byte_decoder,
)

from engine.emitted_text import EmittedOutput, EmittedText
from engine.window_detok import WindowDetokenizer

D = TypeVar("D", "TableBPEDetokenizer", "PiecewiseSPMDetokenizer")

SPACE = 32


class TableBPEDetokenizer(EmittedOutput, BPEStreamingDetokenizer):
    """A BPEStreamingDetokenizer reading token bytes from a precomputed table.

    Text is kept as the pieces emitted (joined only when ``text`` is read) and
    each piece is handed out once by ``push``/``last_segment``: mlx-lm's
    ``self.text +=`` copies the whole reply on every token, which grows with
    the reply's length."""

    def __init__(self, template: BPEStreamingDetokenizer, table: list[bytes], lone: list[bool]):
        self.__dict__.update(template.__dict__)  # tokenmap and settings, shared
        self._table = table
        self._lone_space = lone  # tokens that are a single space: held until the next
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self.tokens = []
        self._unflushed = ""  # held tokens' strings, for mlx-lm's finalize
        self._held = b""  # held tokens' bytes (an incomplete character, a lone space)
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
        held = self._held + raw if self._held else raw
        text = held.decode("utf-8", "replace")
        if lone or text.endswith("\ufffd"):
            self._held = held
            self._unflushed += self.tokenmap[token] if token < len(self._table) else "!"
            return
        self._held = b""
        self._unflushed = ""
        self._out.emit(self._maybe_trim_space(text) if not self._out else text)

    def finalize(self) -> None:
        decoder = _byte_decoder()  # mlx-lm's finalize, exactly (its strict byte map)
        current = bytearray(decoder[c] for c in self._unflushed).decode("utf-8", "replace")
        self._unflushed = ""
        self._held = b""
        self._out.emit(self._maybe_trim_space(current))


class PiecewiseSPMDetokenizer(EmittedOutput, SPMStreamingDetokenizer):
    """mlx-lm's SentencePiece detokenizer, its text kept as the pieces emitted
    (engine.emitted_text): its ``self.text += text`` copied the whole reply on
    every token. Its output is mlx-lm's, segment for segment."""

    def __init__(self, template: SPMStreamingDetokenizer):
        self.__dict__.update(template.__dict__)  # tokenmap and trim_space, shared
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self._unflushed = b""
        self.tokens = []
        self._out = EmittedText()

    def _try_flush(self, force: bool = False) -> None:
        # mlx-lm's, emitting into the pieces ("not self.text": nothing emitted yet)
        text = self._unflushed.replace(self._sep, b" ").decode("utf-8", "replace")
        if not force and text.endswith("\ufffd"):
            return
        if not self._out and self.trim_space and text[:1] == " ":
            text = text[1:]
        self._out.emit(text)
        self._unflushed = b""


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


def detokenizer_factory(tokenizer: Any) -> Callable[[], Any]:
    """A maker of fresh streaming detokenizers for ``tokenizer`` (mlx-lm's
    TokenizerWrapper): the table-driven one for byte-level BPE, a windowed one
    where mlx-lm's would decode each whole line per token (engine.window_detok),
    mlx-lm's for SentencePiece with its text held in pieces."""
    template = tokenizer.detokenizer
    if type(template) is NaiveStreamingDetokenizer:
        hf, clean = template._tokenizer, template._clean_spaces  # noqa: SLF001 - its probe
        return lambda: WindowDetokenizer(hf, clean)
    if type(template) is SPMStreamingDetokenizer:
        return _copies(PiecewiseSPMDetokenizer(template))
    if type(template) is not BPEStreamingDetokenizer:
        return lambda: tokenizer.detokenizer
    decoder = _byte_decoder()
    tokens = [t if isinstance(t, str) else "" for t in template.tokenmap]
    table = [bpe_token_bytes(t) for t in tokens]
    lone = [len(t) == 1 and decoder.get(t) == SPACE for t in tokens]
    return _copies(TableBPEDetokenizer(template, table, lone))


def _copies(proto: D) -> Callable[[], D]:
    """Fresh detokenizers sharing ``proto``'s tables (built once per tokenizer)."""

    def make() -> D:
        fresh = type(proto).__new__(type(proto))
        fresh.__dict__.update(proto.__dict__)
        fresh.reset()
        return fresh

    return make
