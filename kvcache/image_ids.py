"""Images in the token views the KV store compares.

Every token an image covers reaches the model as the same placeholder id (the
vision tower's features replace it), so equal token ids would say nothing about
equal images. In a ``PromptKey`` each image's tokens therefore carry *identity
ids* derived from the image: negative (never a vocabulary id), below the
volatile sentinels. Block hashes, alignment, entry equality and the SSD tier's
manifests then tell images apart with no code of their own; the engine maps
identity ids back to the model's placeholder ids before any token reaches the
model.

An image's *key* (``image_key``) is a 256-bit hash of its content digest and of
the tokens the processor expanded it to. Its tokens are a *run*: token ``k`` is
``IMAGE_ID_BASE - ((h_k << POS_BITS) | k)``, ``h_k`` 42 bits of a stream keyed by
the image's key. The position ``k`` tells where the image starts from any of its
tokens (``image_start``) and where one image ends and the next begins
(``image_runs``); the hashes make the run as a whole carry 42 bits per token, so
a prefix match through an image needs every one of its tokens to agree. One
value for all of an image's tokens (the scheme before this one) carried 48 bits
in all: a birthday search found two images with one identity in 2^24 tries, and
the second got the first one's KV and vision features. The engine keys what it
keeps per image by the 256-bit key, never by a token's value.

An image of fewer than ``MIN_RUN_TOKENS`` tokens (a Pixtral icon is 2, a
Qwen2-VL image under a low --min-pixels can be 1) cannot carry 128 bits in its ids:
its ids come from a key of its request's own (``run_key``), match nothing
stored, and no hit reaches past it. Its features are still kept by its key.
"""

from __future__ import annotations

import hashlib
import os
import struct
from array import array
from collections.abc import Callable, Iterator, Sequence

from kvcache.prompt_key import PromptKey, TokenSpan

# bump with any change to how image tokens are derived: a vision model's stored KV
# lives in a namespace named by it (engine.loader.kv_namespace), so keys written
# under another scheme are never read back; text-only models' namespaces have none
IMAGE_KEY_SCHEME = 2

IMAGE_ID_BASE = -(1 << 40)  # volatile sentinels are small negatives (-1 - rule)
POS_BITS = 20
MAX_IMAGE_TOKENS = 1 << POS_BITS  # an image's tokens carry their position in it
HASH_BITS = 42  # per token; POS_BITS + HASH_BITS = 62: the ids stay within int64
_POS_MASK = MAX_IMAGE_TOKENS - 1
# a run of fewer ids carries under 128 bits: 2^(bits/2) tries find two images sharing it
MIN_RUN_TOKENS = -(-128 // HASH_BITS)
_SHIFT = 64 - HASH_BITS  # the top HASH_BITS of each 64-bit word of the stream


def image_key(digest: bytes, expansion: Sequence[int]) -> bytes:
    """One image's 32-byte key: its content digest and the tokens the processor
    expanded it to (another --max-pixels splits the same pixels differently)."""
    h = hashlib.blake2b(digest_size=32, person=b"kvwarm-image-v2")
    h.update(struct.pack("<Q", len(digest)) + digest)
    h.update(struct.pack("<Q", len(expansion)) + array("q", expansion).tobytes())
    return h.digest()


def run_key(key: bytes, length: int) -> bytes:
    """What the ids of an image of ``length`` tokens derive from: its key, or for
    one too short for its ids to name it safely, a random key of this request's
    own (they then match no stored KV: no hit goes past the image)."""
    return key if length >= MIN_RUN_TOKENS else os.urandom(32)


def image_run(key: bytes, length: int) -> list[int]:
    """The ``length`` identity ids of the image named ``key``, in order."""
    if not 0 < length <= MAX_IMAGE_TOKENS:
        raise ValueError(f"an image takes 1 to {MAX_IMAGE_TOKENS} tokens, not {length}")
    words = struct.unpack(f"<{length}Q", hashlib.shake_256(key).digest(8 * length))
    return [IMAGE_ID_BASE - (((w >> _SHIFT) << POS_BITS) | k) for k, w in enumerate(words)]


def image_tokens(digest: bytes, expansion: Sequence[int]) -> list[int]:
    """An image's identity ids, from what ``image_key`` reads."""
    return image_run(image_key(digest, expansion), len(expansion))


def is_image_id(token: int) -> bool:
    return token <= IMAGE_ID_BASE


def image_position(token: int) -> int:
    """Where an identity id sits in its image (0: the image's first token)."""
    return (IMAGE_ID_BASE - token) & _POS_MASK


def image_start(tokens: Sequence[int], depth: int) -> int:
    """``depth`` moved back to the start of the image it falls inside (KV that
    covers part of an image cannot be resumed: its features come whole)."""
    if not 0 < depth < len(tokens):
        return depth
    if not is_image_id(tokens[depth]) or not is_image_id(tokens[depth - 1]):
        return depth
    k = image_position(tokens[depth])
    if k == 0:
        return depth  # the next image starts here
    start = depth - k
    if start >= 0 and all(
        is_image_id(tokens[start + j]) and image_position(tokens[start + j]) == j for j in range(k)
    ):
        return start
    # ids this scheme never writes (a key of an older format): back to the first
    # of the image ids around ``depth``, whatever they are
    while depth > 0 and is_image_id(tokens[depth - 1]):
        depth -= 1
    return depth


def expand_images(key: PromptKey, slots: Sequence[tuple[int, Sequence[int]]]) -> PromptKey:
    """``key`` with the placeholder token at each ``(position, ids)`` (ascending
    positions) widened to the image's identity ids; volatile spans, message ends
    and the stable prefix move with the text after each image."""
    tokens: list[int] = []
    pos = 0
    for at, ids in slots:
        tokens += key.model_tokens[pos:at]
        tokens += ids
        pos = at + 1

    def moved(p: int) -> int:  # a boundary at p (never inside a placeholder)
        return p + sum(len(ids) - 1 for at, ids in slots if at < p)

    tokens += key.model_tokens[pos:]
    images = [(moved(at), moved(at) + len(ids)) for at, ids in slots]
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
        None if key.newest_user_start is None else moved(key.newest_user_start),
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


def image_runs(tokens: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Each image's ``(start, end)`` in ``tokens``: a run of identity ids whose
    positions count up by one. The same image twice in a row is two runs, as are
    two images; ids that do not count up (a key of an older format) are runs of
    one token each, which no image's run matches."""
    i, n = 0, len(tokens)
    while i < n:
        if not is_image_id(tokens[i]):
            i += 1
            continue
        j = i + 1
        k = image_position(tokens[i])
        while j < n and is_image_id(tokens[j]) and image_position(tokens[j]) == k + 1:
            j += 1
            k += 1
        yield i, j
        i = j


def run_digest(run: Sequence[int]) -> bytes:
    """Names an image's run of identity ids by all of its tokens (128 bits)."""
    return hashlib.blake2b(array("q", run).tobytes(), digest_size=16).digest()


def real_tokens(
    tokens: Sequence[int], expansion: Callable[[Sequence[int]], Sequence[int]]
) -> list[int]:
    """The model's ids for a key's tokens: each image's run becomes the tokens
    ``expansion`` gives for the whole run (found by all of its ids: see
    ``run_digest``; it raises KeyError for a run of no image it knows)."""
    out = list(tokens)
    for start, end in image_runs(tokens):
        exp = expansion(tokens[start:end])
        if len(exp) != end - start:
            raise KeyError(f"an image run of {end - start} tokens for {len(exp)} image tokens")
        out[start:end] = exp
    return out
