"""Images in the token views the KV store compares.

Every token an image covers reaches the model as the same placeholder id (the
vision tower's features replace it), so equal token ids would say nothing about
equal images. In a ``PromptKey`` each image's tokens therefore carry one
*identity id* derived from the image's content digest: negative (never a
vocabulary id), below the volatile sentinels, and equal for two images only if
their decoded pixels (and how the processor split them) are. Block hashes,
alignment, entry equality and the SSD tier's manifests then tell images apart
with no code of their own; the engine maps identity ids back to the model's
placeholder ids before any token reaches the model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence

from kvcache.prompt_key import PromptKey, TokenSpan

IMAGE_ID_BASE = -(1 << 40)  # volatile sentinels are small negatives (-1 - rule)
_ID_SPACE = 1 << 48


def image_identity(digest: bytes, expansion: Sequence[int]) -> int:
    """One image's identity id: its content digest and the tokens the processor
    expanded it to (another --max-pixels splits the same pixels differently)."""
    h = hashlib.blake2b(digest, digest_size=8)
    h.update(",".join(map(str, expansion)).encode())
    return IMAGE_ID_BASE - int.from_bytes(h.digest(), "little") % _ID_SPACE


def is_image_id(token: int) -> bool:
    return token <= IMAGE_ID_BASE


def image_start(tokens: Sequence[int], depth: int) -> int:
    """``depth`` moved back to the start of the image it falls inside (KV that
    covers part of an image cannot be resumed: its features come whole)."""
    if not 0 < depth < len(tokens):
        return depth
    ident = tokens[depth]
    if not is_image_id(ident) or tokens[depth - 1] != ident:
        return depth
    while depth > 0 and tokens[depth - 1] == ident:
        depth -= 1
    return depth


def expand_images(key: PromptKey, slots: Sequence[tuple[int, int, int]]) -> PromptKey:
    """``key`` with the placeholder token at each ``(position, length, identity)``
    (ascending positions) widened to ``length`` identity tokens; volatile spans,
    message ends and the stable prefix move with the text after each image."""
    tokens: list[int] = []
    pos = 0
    for at, length, identity in slots:
        tokens += key.model_tokens[pos:at]
        tokens += [identity] * length
        pos = at + 1

    def moved(p: int) -> int:  # a boundary at p (never inside a placeholder)
        return p + sum(length - 1 for at, length, _ in slots if at < p)

    tokens += key.model_tokens[pos:]
    images = [(moved(at), moved(at) + length) for at, length, _ in slots]
    spans = [
        piece
        for s in key.spans
        for piece in _around(TokenSpan(moved(s.start), moved(s.end), s.rule), images)
    ]
    return PromptKey.build(
        tokens,
        spans,
        [moved(e) for e in key.message_ends],
        moved(key.stable_prefix_end),
    )


def _around(span: TokenSpan, images: Sequence[tuple[int, int]]) -> Iterator[TokenSpan]:
    """The parts of a volatile span outside every image: an image inside a volatile
    block (a screenshot in a <system-reminder>) is compared exactly, never stepped
    over as a stale value, or a different image would hit the first one's KV."""
    start = span.start
    for a, b in images:  # ascending, disjoint
        if b <= start or a >= span.end:
            continue
        if a > start:
            yield TokenSpan(start, a, span.rule)
        start = b
    if start < span.end:
        yield TokenSpan(start, span.end, span.rule)


def image_runs(tokens: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Each maximal run of one identity id: ``(identity, start, end)``. A run is one
    image, or the same image several times in a row."""
    i = 0
    while i < len(tokens):
        ident = tokens[i]
        if not is_image_id(ident):
            i += 1
            continue
        j = i
        while j < len(tokens) and tokens[j] == ident:
            j += 1
        yield ident, i, j
        i = j


def real_tokens(tokens: Sequence[int], expansions: Mapping[int, Sequence[int]]) -> list[int]:
    """The model's ids for a key's tokens: each identity run becomes its image's
    tokens (a run of the same image twice in a row repeats them)."""
    out = list(tokens)
    for ident, start, end in image_runs(tokens):
        exp = expansions[ident]
        out[start:end] = [exp[k % len(exp)] for k in range(end - start)]
    return out
