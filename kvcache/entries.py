"""What the prefix-cache index keeps and answers: its config, entries (with the
bytes they hold per tier), hits, lookups and counters, and the listener the
payload side implements. Pure data (no MLX)."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from kvcache.blocks import Digest, EntryBytes
from kvcache.prompt_key import Alignment, PromptKey


class VolatilePolicy(str, enum.Enum):
    REUSE = "reuse"  # reuse KV past volatile spans (the model keeps the old values)
    STRICT = "strict"  # reuse exact model-token prefixes only
    RELOCATE = "relocate"  # volatile lines moved to the prompt's end; exact prefixes


@dataclass(frozen=True)
class PromptCacheConfig:
    """The prefix cache's knobs (``--prompt-cache-*``, ``--cache-block-size``,
    ``--volatile-policy``, ``--kv-*``)."""

    max_bytes: int | None = None  # None: a quarter of what weights and reserve leave
    block_size: int = 16  # cache-key tokens per lookup block
    ttl_s: float = 0.0  # 0: entries never expire
    policy: VolatilePolicy = VolatilePolicy.REUSE
    max_entries: int = 256  # entries in RAM
    kv_block_size: int = 64  # model tokens per stored (shared) KV block
    eviction: str = "cost-aware"

    def resolve_bytes(self, free_bytes: int) -> int:
        return self.max_bytes if self.max_bytes is not None else max(0, free_bytes // 4)


@dataclass
class CacheEntry:
    entry_id: int
    key: PromptKey
    held: EntryBytes
    trimmable: bool
    hashes: list[bytes]
    session: str | None = None
    created: float = 0.0
    last_used: float = 0.0
    # wall clock its KV was stored (after a restart, its manifest's): which of a
    # conversation's turns came last
    stored_at: float = 0.0
    hits: int = 0
    refs: int = 0  # requests currently reading this entry's KV
    superseded: bool = False  # a longer entry covers it; removed once no longer read
    # its conversation was deleted while read: no lookup finds it, its disk copy
    # is gone, and it leaves RAM when released
    forgotten: bool = False
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)  # its name on disk
    in_ram: bool = True
    on_disk: bool = False  # fully written: a restart finds it
    persisting: bool = False  # disk bytes reserved, the write not finished
    # its queued write is larger than the write queue's share of the budget: the
    # queue holds its arrays until written, so leaving RAM would free nothing and
    # let RAM + queue outgrow the budget; it stays (counted) until the write ends
    holds_queue: bool = False
    # writes begun: a write's end counts only if it is the latest one's (an older
    # write, dropped while queued, would mark the entry written when it is not)
    writes: int = 0
    pinned: bool = False  # saved by a user: never evicted from disk
    variant: str = ""  # how its KV is stored ("" full precision, "q8g64s0", ...)
    # ``session`` is the id its conversation named itself by (CacheHints.own_conversation),
    # not a fallback guess or a shared prompt_cache_key another client may send too
    own_session: bool = False

    @property
    def length(self) -> int:
        return len(self.key.model_tokens)

    @property
    def nbytes(self) -> int:
        return self.held.total

    @property
    def loadable(self) -> bool:
        """Its KV can be had now: in RAM, or fully on disk."""
        return self.in_ram or self.on_disk


class TierListener(Protocol):
    """Told when an entry leaves a tier, with the blocks nobody there uses any more."""

    def left_ram(self, entry: CacheEntry, freed: list[Digest]) -> None: ...

    def left_disk(self, entry: CacheEntry, freed: list[Digest]) -> None: ...


class NoListener:
    """The listener of an index nobody keeps payloads for (tests, benchmarks)."""

    def left_ram(self, entry: CacheEntry, freed: list[Digest]) -> None:
        pass

    def left_disk(self, entry: CacheEntry, freed: list[Digest]) -> None:
        pass


@dataclass(frozen=True)
class CacheHit:
    entry: CacheEntry
    alignment: Alignment

    @property
    def reused(self) -> int:
        return self.alignment.request_depth


@dataclass
class Lookup:
    """The outcome of one lookup, with what the request log and /stats need."""

    hit: CacheHit | None = None
    candidates: int = 0
    rejected: list[str] = field(default_factory=list)  # why candidates were turned down
    layer: str = "global"  # which layer found the hit: global (block chain) or session
    # candidates whose alignment was cut back to the start of an image
    retreated: set[int] = field(default_factory=set)
    tier: str = "none"  # where the hit's KV was when chosen: ram, disk, or none (a miss)
    judged: set[int] = field(default_factory=set)  # entries aligned so far
    # the deepest reuse an untrimmable entry would have given had it been cut back
    uncut_depth: int = 0


@dataclass
class IndexCounters:
    lookups: int = 0
    tokens_queried: int = 0  # prompt tokens looked up: the denominator of the token hit rate
    hits: int = 0
    misses: int = 0
    session_hits: int = 0
    tokens_reused: int = 0
    stale_volatile_reuse: int = 0
    exact_key_rejected_by_model_lcp: int = 0
    hybrid_trim_miss: int = 0
    vlm_retreat: int = 0  # a hit cut back to the start of an image it ended inside
    inserts: int = 0
    evictions: int = 0  # entries dropped from RAM with nowhere else to go
    demotions: int = 0  # entries moved from RAM to disk
    promotions: int = 0  # disk entries brought back into RAM by a hit
    disk_hits: int = 0
    disk_tokens_reused: int = 0
    disk_evictions: int = 0
    expired: int = 0
    superseded: int = 0  # shorter strict prefixes removed when a longer entry arrived
