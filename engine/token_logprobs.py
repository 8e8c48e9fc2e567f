"""Log probabilities of generated tokens and their likeliest alternatives.

mlx-lm's BatchGenerator already hands each row its step's log-softmax over the
vocabulary (the distribution its sampler drew from); this reads the chosen
token's value and the top ``k`` out of it, only for rows that asked, and names
each token by the bytes it adds to the text.

The reading runs on a stream of its own: by then the generator has queued the
next step's forward on the default stream, and an op queued behind it would wait
for the whole forward (1.4 s against 1 ms measured here), stalling every row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
)

from engine.fast_detok import bpe_token_bytes, strict_bpe_bytes
from engine.window_detok import BYTE_TOKEN, anchor
from scheduler.request import TokenChoice, TokenLogprob

SPM_SPACE = "\u2581".encode()

PieceOf = Callable[[int], bytes]


@dataclass(frozen=True)
class TokenPieces:
    """Token id -> the bytes it adds to the text: ``later`` mid-reply, ``first``
    as a reply's first token (a decoder may drop a sequence's leading space)."""

    later: PieceOf
    first: PieceOf


def token_pieces(tokenizer: Any) -> TokenPieces:
    """Each token's bytes in the text, the way the tokenizer's own streaming
    detokenizer reads it (byte-level BPE, SentencePiece, or decoding)."""
    template = tokenizer.detokenizer
    if isinstance(template, BPEStreamingDetokenizer):
        names = template.tokenmap

        def bpe(token: int) -> bytes:
            name = names[token] if token < len(names) else None
            return bpe_token_bytes(name) if isinstance(name, str) else b""

        return TokenPieces(bpe, bpe)
    if isinstance(template, SPMStreamingDetokenizer):
        table = template.tokenmap

        def spm(token: int) -> bytes:
            return table[token].replace(SPM_SPACE, b" ") if token < len(table) else b""

        return TokenPieces(spm, spm)
    decoded = DecodedPieces(tokenizer)
    return TokenPieces(decoded.later, decoded.first)


class DecodedPieces:
    """Pieces of a tokenizer read by decoding (engine.window_detok streams its
    text): a token's text after a neutral token, since decoded alone a Metaspace
    token loses the space it has mid-reply; alone only as a reply's first, as
    decoding the reply reads it. Where that text has U+FFFD, a byte token inside
    a UTF-8 character, the byte itself. Decoded once per token id, when first
    asked for: a vocabulary's worth at most, whatever the replies' lengths.

    A reply's pieces join to its text's UTF-8, or, where the text has U+FFFD for
    bytes that are no character, to those bytes (decoding them gives the text);
    not where the decoder rewrites across tokens (a space clean-up: "it ' s"
    decodes to "it's"), which no piece per token can say."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._size = len(tokenizer)
        self._anchor = anchor(tokenizer)
        self._later: dict[int, bytes] = {}
        self._first: dict[int, bytes] = {}

    def later(self, token: int) -> bytes:
        return self._cached(self._later, token, self._anchor)

    def first(self, token: int) -> bytes:
        return self._cached(self._first, token, None)

    def _cached(self, known: dict[int, bytes], token: int, anchor: tuple[int, str] | None) -> bytes:
        piece = known.get(token)
        if piece is None:
            piece = known[token] = self._piece(token, anchor)
        return piece

    def _piece(self, token: int, anchor: tuple[int, str] | None) -> bytes:
        if not 0 <= token < self._size:  # a padded head's ids name nothing
            return b""
        decode = self._tokenizer.decode
        after = decode([anchor[0], token]) if anchor is not None else ""
        if anchor is not None and after.startswith(anchor[1]):
            text = after[len(anchor[1]) :]
        else:
            text = decode([token])
        if "\ufffd" in text:
            raw = _raw_bytes(self._tokenizer.convert_ids_to_tokens(token))
            if raw is not None:
                return raw
        return text.encode()


def _raw_bytes(name: object) -> bytes | None:
    """A byte token's bytes from its vocabulary name: SentencePiece's ``<0xE6>``,
    byte-level BPE's characters (``æ``), or bytes as tiktoken-style vocabularies
    hold them; None for any other name (its decoded text stands)."""
    if isinstance(name, bytes):
        return name
    if not isinstance(name, str) or not name:
        return None
    if match := BYTE_TOKEN.fullmatch(name):
        return bytes([int(match[1], 16)])
    return strict_bpe_bytes(name)


@dataclass(frozen=True)
class Asked:
    """One row's share of a step whose request asked for log probabilities."""

    logprobs: mx.array  # the step's log-softmax for the row (vocabulary-sized, evaluated)
    token: int
    top: int  # alternatives wanted
    first: bool = False  # the reply's first token (TokenPieces.first names them all)


def token_logprobs(
    asked: list[Asked], pieces: TokenPieces, stream: mx.Stream
) -> list[TokenLogprob]:
    """Each row's chosen token with its log probability and its ``top`` likeliest
    tokens, most likely first (ties: the lower id first): the rows of one step
    together, in one evaluation on ``stream``."""
    if not asked:
        return []
    with mx.stream(stream):
        stacked = mx.stack([a.logprobs for a in asked]).astype(mx.float32)
        mx.eval(stacked)
    # numpy's partition is 3x MLX's on the CPU (1.7 against 5.7 ms for 8 rows of 49k)
    values = np.asarray(stacked)
    chosen = values[np.arange(len(asked)), [a.token for a in asked]].tolist()
    k = min(max(a.top for a in asked), values.shape[-1])
    if k > 0:
        ids = np.argpartition(values, values.shape[-1] - k, axis=-1)[:, -k:]
        id_rows = ids.tolist()
        top_rows = np.take_along_axis(values, ids, axis=-1).tolist()
    else:
        id_rows = top_rows = [[] for _ in asked]
    entries = []
    for r, (a, value, row_ids, row_values) in enumerate(zip(asked, chosen, id_rows, top_rows)):
        pairs = sorted(zip(row_values, row_ids), key=lambda p: (-p[0], p[1]))[: a.top]
        if pairs and pairs[-1][0] == min(row_values):
            pairs = _lowest_ids_at_the_cut(values[r], pairs)
        piece = pieces.first if a.first else pieces.later
        entries.append(
            TokenLogprob(
                TokenChoice(a.token, value, piece(a.token)),
                tuple(TokenChoice(i, v, piece(i)) for v, i in pairs),
            )
        )
    return entries


def _lowest_ids_at_the_cut(
    values: np.ndarray, pairs: list[tuple[float, int]]
) -> list[tuple[float, int]]:
    """The partition keeps any of the ids tied at the cut-off value; the lowest
    ones are wanted (a bf16 model ties often). Those above it stay."""
    cut = pairs[-1][0]
    above = [p for p in pairs if p[0] > cut]
    tied = np.flatnonzero(values == cut)[: len(pairs) - len(above)].tolist()
    return above + [(cut, i) for i in tied]
