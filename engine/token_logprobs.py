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
from typing import Any

import mlx.core as mx
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from engine.fast_detok import bpe_token_bytes
from scheduler.request import TokenChoice, TokenLogprob

SPM_SPACE = "\u2581".encode()


def token_pieces(tokenizer: Any) -> Callable[[int], bytes]:
    """Token id -> its bytes in the text, the way the tokenizer's own streaming
    detokenizer reads it (byte-level BPE, SentencePiece, or plain decoding)."""
    template = tokenizer.detokenizer
    if isinstance(template, BPEStreamingDetokenizer):
        names = template.tokenmap

        def bpe(token: int) -> bytes:
            name = names[token] if token < len(names) else None
            return bpe_token_bytes(name) if isinstance(name, str) else b""

        return bpe
    if isinstance(template, SPMStreamingDetokenizer):
        table = template.tokenmap

        def spm(token: int) -> bytes:
            return table[token].replace(SPM_SPACE, b" ") if token < len(table) else b""

        return spm
    return lambda token: tokenizer.decode([token]).encode()


def token_logprob(
    logprobs: mx.array,
    token: int,
    top: int,
    piece: Callable[[int], bytes],
    stream: mx.Stream,
) -> TokenLogprob:
    """``token``'s entry of one row's step ``logprobs`` (vocabulary-sized and
    already evaluated), with the ``top`` likeliest tokens, most likely first (ties:
    the lower id first), read on ``stream``."""
    with mx.stream(stream):
        values = logprobs.astype(mx.float32)
        chosen_value = values[token]
        if top <= 0:
            return TokenLogprob(TokenChoice(token, chosen_value.item(), piece(token)))
        k = min(top, values.shape[-1])
        ids = mx.argpartition(-values, kth=k - 1)[:k]
        top_values = values[ids]
        mx.eval(chosen_value, ids, top_values)
    chosen = TokenChoice(token, chosen_value.item(), piece(token))
    pairs = sorted(zip(top_values.tolist(), ids.tolist()), key=lambda p: (-p[0], p[1]))
    return TokenLogprob(chosen, tuple(TokenChoice(i, v, piece(i)) for v, i in pairs))
