"""A character a reply ends inside (max_tokens cut it) is dropped, not replaced.

Decoded with ``errors="replace"``, a reply cut between a character's bytes
ended in U+FFFD ("Done \ufffd"). Only a truly incomplete end is dropped: bytes
more bytes could still make a character. Invalid bytes anywhere (the end
included) stay U+FFFD, as before.
"""

from __future__ import annotations

import codecs


def cut_length(data: bytes) -> int:
    """Bytes at the end of ``data`` that begin a character more bytes could complete."""
    _, used = codecs.utf_8_decode(data, "replace", False)
    tail = data[used:]
    return len(tail) if tail and _completable(tail) else 0


def complete_text(data: bytes) -> str:
    """``data`` decoded, invalid bytes replaced, a character it ends inside dropped."""
    cut = cut_length(data)
    return (data[: len(data) - cut] if cut else data).decode("utf-8", "replace")


def _completable(tail: bytes) -> bool:
    """Whether more bytes could make ``tail`` (what Python's incremental decoder
    holds back) a character: it holds a surrogate's start (ED A0) too, which never is."""
    size = 2 if tail[0] < 0xE0 else 3 if tail[0] < 0xF0 else 4
    pad = b"\x80" * (size - len(tail) - 1)
    for b in range(0x80, 0xC0):
        try:
            (tail + bytes((b,)) + pad).decode("utf-8")
        except UnicodeDecodeError:
            continue
        return True
    return False
