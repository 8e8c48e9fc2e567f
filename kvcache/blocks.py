"""Content-addressed KV blocks and the byte ledger of one tier.

Stored KV is cut into blocks of ``block_size`` model tokens. A block's address
is a hash chained over every model token up to its end, namespaced by the
model and cache format: equal addresses mean equal KV, so entries that share a
prefix (eight agents with one system prompt) share its blocks, and a tier
holds each block once however many entries use it. Positions past the last
full block, and layers that are not per-position KV (sliding windows,
recurrent states), are the entry's own ("private") bytes.

Pure bookkeeping: the arrays live in ``kvcache.payloads`` (engine thread) and
the files in ``kvcache.disk``; this module only counts who uses what.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvcache.prompt_key import chain_hashes

Digest = bytes


def block_digests(tokens: Sequence[int], block_size: int, namespace: str) -> list[Digest]:
    """The address of each full block of ``tokens``, each chained with its parent's
    (the index's chain over model tokens, in a namespace of its own)."""
    return chain_hashes(tokens, block_size, f"kv-blocks|{namespace}")


@dataclass(frozen=True)
class EntryBytes:
    """What one entry holds in a tier: shared blocks (address, bytes) and its own bytes."""

    blocks: tuple[tuple[Digest, int], ...] = ()
    private: int = 0

    @property
    def total(self) -> int:
        """Bytes if nothing were shared."""
        return self.private + sum(n for _, n in self.blocks)


@dataclass
class TierLedger:
    """Bytes one tier holds, counting each shared block once."""

    max_bytes: int
    nbytes: int = 0
    private_bytes: int = 0
    refs: dict[Digest, int] = field(default_factory=dict)
    sizes: dict[Digest, int] = field(default_factory=dict)
    logical_bytes: int = 0  # what the same entries would hold without sharing

    @property
    def block_bytes(self) -> int:
        return self.nbytes - self.private_bytes

    @property
    def shared_saved_bytes(self) -> int:
        return self.logical_bytes - self.nbytes

    def added_bytes(self, held: EntryBytes) -> int:
        """Bytes this tier would grow by if ``held`` joined it."""
        new = {d: n for d, n in held.blocks if d not in self.refs}
        return held.private + sum(new.values())

    def fits(self, held: EntryBytes) -> bool:
        return self.nbytes + self.added_bytes(held) <= self.max_bytes

    def add(self, held: EntryBytes) -> list[Digest]:
        """Count ``held`` in; the blocks this tier did not hold before."""
        fresh: list[Digest] = []
        for digest, n in held.blocks:
            count = self.refs.get(digest, 0)
            if count == 0:
                self.sizes[digest] = n
                self.nbytes += n
                fresh.append(digest)
            self.refs[digest] = count + 1
        self.private_bytes += held.private
        self.nbytes += held.private
        self.logical_bytes += held.total
        return fresh

    def remove(self, held: EntryBytes) -> list[Digest]:
        """Count ``held`` out; the blocks no entry in this tier uses any more."""
        freed: list[Digest] = []
        for digest, _ in held.blocks:
            count = self.refs[digest] - 1
            if count == 0:
                del self.refs[digest]
                self.nbytes -= self.sizes.pop(digest)
                freed.append(digest)
            else:
                self.refs[digest] = count
        self.private_bytes -= held.private
        self.nbytes -= held.private
        self.logical_bytes -= held.total
        return freed

    def holds(self, digests: Iterable[Digest]) -> bool:
        return all(d in self.refs for d in digests)

    @property
    def blocks(self) -> int:
        return len(self.refs)
