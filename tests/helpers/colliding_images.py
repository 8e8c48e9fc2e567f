"""Images whose short hashes collide, without a birthday search.

``kvcache.image_ids`` names images through ``hashlib``; ``collide`` swaps in one
whose short per-image values are the same for every image. The scheme before
per-position ids gave an image one 48-bit id (blake2b with 8-byte digests): here
it is the same for all images, as for two images a 2^24-try search finds. Each
image's token ``k`` now hashes 8 bytes of a SHAKE-256 stream keyed by the image:
every word but the one for ``keep`` is the same for all images, so two images
agree at every token but ``keep``. Other hashes (the image's 256-bit key, run
digests) stay real."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest


class _Fixed:
    def __init__(self, real: Any):
        self._real = real

    def update(self, data: bytes) -> None:
        self._real.update(data)

    def digest(self) -> bytes:
        return bytes(self._real.digest_size)


class _Stream:
    def __init__(self, real: Any, keep: int | None):
        self._real, self._keep = real, keep

    def update(self, data: bytes) -> None:
        self._real.update(data)

    def digest(self, length: int) -> bytes:
        real = self._real.digest(length)
        out = bytearray(length)
        if self._keep is not None:  # a negative one counts from the run's end
            at = 8 * (self._keep % (length // 8))
            out[at : at + 8] = real[at : at + 8]
        return bytes(out)


class CollidingHashlib:
    def __init__(self, keep: int | None):
        self.keep = keep

    def blake2b(self, data: bytes = b"", **kwargs: Any) -> Any:
        real = hashlib.blake2b(data, **kwargs)
        return _Fixed(real) if kwargs.get("digest_size") == 8 else real

    def shake_256(self, data: bytes = b"") -> Any:
        return _Stream(hashlib.shake_256(data), self.keep)

    def __getattr__(self, name: str) -> Any:
        return getattr(hashlib, name)


def collide(monkeypatch: pytest.MonkeyPatch, keep: int | None = None) -> None:
    """From now on (the test's end) every image's short hashes collide, except at
    token ``keep`` of its run (-1: its last; None: at every token)."""
    import kvcache.image_ids

    monkeypatch.setattr(kvcache.image_ids, "hashlib", CollidingHashlib(keep))
