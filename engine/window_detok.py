"""A streaming detokenizer for tokenizers mlx-lm has no table for, in linear time.

mlx-lm's ``NaiveStreamingDetokenizer`` (every tokenizer that is neither
byte-level BPE nor its SentencePiece shape: Metaspace decoders, tiktoken-based
ones) decodes the whole current line again for every token: a reply with no
newline (minified JSON, a CJK paragraph) cost 5 s of engine-thread time at 8k
tokens, stalling every row. This one decodes a short window instead: the
tokens since the last emitted text plus a few before them as context (a
decoder may treat a sequence's first token differently, e.g. drop its leading
space), and emits what the window's text adds past what was emitted.

Held back: an incomplete character (the text ends in U+FFFD; once a few more
tokens have not completed it, it is a real one), and, where the tokenizer
cleans up spaces (``"a ,"`` decodes to ``"a,"``), a tail the cleanup may
still rewrite once the next token comes (a space, ``" '"``, ``" n'"``...).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from mlx_lm.tokenizer_utils import _byte_decoder

from engine.emitted_text import EmittedOutput, EmittedText
from engine.utf8_tail import cut_length

CONTEXT = 4  # tokens decoded before the new ones, never emitted again
WINDOW = 16  # tokens a window may reach before it restarts from its last CONTEXT
MAX_HELD = 8  # tokens held for an incomplete character before real U+FFFDs are looked for
# the bytes an incomplete UTF-8 character has so far: at most this many tokens
PENDING = 3
# what Hugging Face's clean_up_tokenization rewrites; a text ending in the start
# of one may change when the next token comes (" '" + " " is "'", " n" + "'t" "n't")
CLEANUPS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")
# and in cascade: " ' " made "'", whose " 's" then takes the space before it too
# ("x  ' s" decodes to "x's": both spaces go)
CASCADES = ("  ' s", "  ' m", "  ' ve", "  ' re")
_OPEN_CLEANUPS = frozenset(c[:k] for c in CLEANUPS + CASCADES for k in range(1, len(c)))
_LONGEST_OPEN = max(map(len, _OPEN_CLEANUPS))
# a character's bytes (at most 4) begin within the last this many tokens
CUT_TOKENS = 4
# SentencePiece's byte-fallback tokens: one byte each, named by its value
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def cleanup_tail(text: str) -> int:
    """Characters at the end of ``text`` a space cleanup may still rewrite."""
    for k in range(min(_LONGEST_OPEN, len(text)), 0, -1):
        if text[-k:] in _OPEN_CLEANUPS:
            return k
    return 0


class WindowDetokenizer(EmittedOutput):
    """The ``StreamingDetokenizer`` interface ``engine.text_output`` reads, over
    ``tokenizer.decode`` (a Hugging Face tokenizer)."""

    def __init__(
        self,
        tokenizer: Any,
        clean_spaces: bool,
        token_bytes: Callable[[int], bytes] | None = None,
    ):
        self._tokenizer = tokenizer
        self._clean_spaces = clean_spaces
        self._token_bytes = token_bytes  # None: tokens never hold part of a character
        self._lead: list[int] = []  # decoded before the first token (keep_leading_space)
        self._lead_text = ""
        self.reset()

    def keep_leading_space(self) -> None:
        """Keep the space a decoder drops before a sequence's first word (Metaspace:
        a completion's " world" came back "world"): windows from the first token
        decode after one lead token, whose text is cut (later ones have context)."""
        lead = anchor(self._tokenizer) if hasattr(self._tokenizer, "encode") else None
        if lead is not None:
            self._lead, self._lead_text = [lead[0]], lead[1]

    def reset(self) -> None:
        self.offset = 0
        self.tokens: list[int] = []
        self._start = 0  # the window's first token
        self._done = 0  # characters of the window's text already emitted (or context)
        self._emitted_at = 0  # tokens when text was last emitted
        self._out = EmittedText()

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        n = len(self.tokens)
        window = self._decode(self._start)
        safe, held = len(window), 0  # held: the last tokens whose text waits (None: unknown)
        if window.endswith("\ufffd"):
            safe, held = len(window.rstrip("\ufffd")), None
            if n - self._emitted_at > MAX_HELD:
                settled = self._settled(window)
                if settled > safe:
                    safe, held = settled, PENDING
        elif self._clean_spaces and (tail := cleanup_tail(window)):
            safe -= tail
            held = None
        if safe > self._done:
            self._out.emit(window[self._done : safe])
            self._done = safe
            self._emitted_at = n
        if n - self._start < WINDOW:
            return
        if held is not None:
            self._restart(n - held)
        else:
            self._restart_in_cleanup(window, safe)

    def _restart_in_cleanup(self, window: str, safe: int) -> None:
        """Restart before the last tokens that hold the cleanup tail (a run of space
        tokens holds one for ever: the window grew with the run, each token
        decoding it all again), carrying what of their text was emitted."""
        n = len(self.tokens)
        for held in range(1, PENDING + 1):
            before = self._decode(self._start, n - held)
            if len(before) <= safe and window.startswith(before):
                self._restart(n - held, window[len(before) : safe])
                return

    def _restart(self, end: int, carried: str = "") -> None:
        """Start the window ``CONTEXT`` tokens before ``end`` (all text before
        ``end`` emitted, and ``carried`` of what follows), if the longer window's
        text begins with the context's and that."""
        start = max(self._start, end - CONTEXT)
        context = self._decode(start, end)
        if self._decode(start).startswith(context + carried):
            self._start, self._done = start, len(context) + len(carried)

    def _settled(self, window: str) -> int:
        """How much of a window ending in U+FFFD is text: what all but its last
        ``PENDING`` tokens decode to, when the window still begins with it (an
        incomplete character lies within those last tokens; earlier U+FFFDs are
        real ones, which held back, streamed nothing and grew the window)."""
        before = self._decode(self._start, len(self.tokens) - PENDING)
        return len(before) if window.startswith(before) else 0

    def finalize(self) -> None:
        window = self._without_cut_character(self._decode(self._start))
        if len(window) > self._done:
            self._out.emit(window[self._done :])
        self._start = len(self.tokens)
        self._done = 0
        self._emitted_at = len(self.tokens)

    def _decode(self, start: int, end: int | None = None) -> str:
        """The text of ``tokens[start:end]``, from the first token after the lead."""
        ids = self.tokens[start:end]
        if start or not self._lead:
            return str(self._tokenizer.decode(ids))
        text = str(self._tokenizer.decode(self._lead + ids))
        lead = self._lead_text
        return text[len(lead) :] if text.startswith(lead) else str(self._tokenizer.decode(ids))

    def _without_cut_character(self, window: str) -> str:
        """The window less a character the reply ends inside (engine.utf8_tail):
        decoded without the tokens holding only its bytes (a byte-fallback decode
        turns their whole run to U+FFFDs), else less the one U+FFFD a lossy decode
        made of it."""
        read = self._token_bytes
        if read is None or not window.endswith("\ufffd"):
            return window
        n = len(self.tokens)
        pieces = [read(t) for t in self.tokens[max(self._start, n - CUT_TOKENS) :]]
        cut = cut_length(b"".join(pieces))
        if not cut:
            return window
        k = size = 0
        while size < cut:  # the last tokens the character's bytes are in
            k += 1
            size += len(pieces[-k])
        if size == cut:
            shorter = self._decode(self._start, n - k)
            if shorter.startswith(window[: self._done]):
                return shorter
        return window[:-1]


def token_bytes(tokenizer: Any) -> Callable[[int], bytes] | None:
    """A token's bytes, for a Hugging Face tokenizer whose tokens may hold part of
    a character (a ByteLevel or ByteFallback decoder); None where they never do
    (a Metaspace or word decoder) or cannot be read (no tokenizers backend: its
    decode's U+FFFD stays)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return None
    kinds = set(re.findall(r'"type":\s*"(\w+)"', decoder.__getstate__().decode()))
    byte_level, fallback = "ByteLevel" in kinds, "ByteFallback" in kinds
    if not (byte_level or fallback):
        return None
    table = _byte_decoder()

    def read(token: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return b""
        if fallback and (m := BYTE_TOKEN.fullmatch(piece)):
            return bytes((int(m[1], 16),))
        if byte_level and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.encode()  # whole text

    return read


def anchor(tokenizer: Any) -> tuple[int, str] | None:
    """A token to decode others after, with its text: the last of "a"'s (a plain
    word: no space for a decoder to drop, no character left open)."""
    ids = tokenizer.encode("a", add_special_tokens=False)
    if not ids:
        return None
    head = tokenizer.decode(ids[-1:])
    return (ids[-1], head) if head and "\ufffd" not in head else None
