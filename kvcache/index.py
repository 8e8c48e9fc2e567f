"""Global prefix-cache index: block-hash chains over cache-key tokens.

Pure bookkeeping (no MLX): each entry stands for a KV payload the engine keeps
under the same id. Cache-key tokens are split into fixed blocks whose hashes are
chained, so one dict lookup per block walks the request's chain to the deepest
depth any entry shares. The candidates found there are then aligned in
model-token space (``prompt_key.align``), which alone decides how much KV is
reused; the deepest accepted alignment wins.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvcache.prompt_key import Alignment, PromptKey, align, chain_hashes

MAX_CANDIDATES = 16


class VolatilePolicy(str, enum.Enum):
    REUSE = "reuse"  # reuse KV past volatile spans (the model keeps the old values)
    STRICT = "strict"  # reuse exact model-token prefixes only
    RELOCATE = "relocate"  # volatile lines moved to the prompt's end; exact prefixes


def _strict_prefix(short: PromptKey, long: PromptKey) -> bool:
    """``short``'s model tokens are a strict prefix of ``long``'s."""
    n = len(short.model_tokens)
    return n < len(long.model_tokens) and long.model_tokens[:n] == short.model_tokens


@dataclass(frozen=True)
class PromptCacheConfig:
    """The prefix cache's knobs (``--prompt-cache-*``, ``--cache-block-size``, ``--volatile-policy``)."""

    max_bytes: int | None = None  # None: a quarter of what weights and reserve leave
    block_size: int = 16
    ttl_s: float = 0.0  # 0: entries never expire
    policy: VolatilePolicy = VolatilePolicy.REUSE
    max_entries: int = 256

    def resolve_bytes(self, free_bytes: int) -> int:
        return self.max_bytes if self.max_bytes is not None else max(0, free_bytes // 4)


@dataclass
class CacheEntry:
    entry_id: int
    key: PromptKey
    nbytes: int
    trimmable: bool
    hashes: list[bytes]
    session: str | None = None
    created: float = 0.0
    last_used: float = 0.0
    hits: int = 0
    refs: int = 0  # requests currently reading this entry's KV
    superseded: bool = False  # a longer entry covers it; removed once no longer read

    @property
    def length(self) -> int:
        return len(self.key.model_tokens)


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
    inserts: int = 0
    evictions: int = 0
    expired: int = 0
    superseded: int = 0  # shorter strict prefixes removed when a longer entry arrived


class PrefixIndex:
    def __init__(
        self,
        *,
        max_bytes: int,
        max_entries: int = 256,
        block_size: int = 16,
        ttl_s: float = 0.0,
        namespace: str = "",
        policy: VolatilePolicy = VolatilePolicy.REUSE,
        on_remove: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if block_size < 1:
            raise ValueError("block size must be >= 1")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.namespace = namespace
        self.policy = policy
        self._on_remove = on_remove or (lambda _id: None)
        self._clock = clock
        self._entries: dict[int, CacheEntry] = {}
        self._by_hash: dict[bytes, set[int]] = {}
        self._next_id = 1
        self.nbytes = 0
        self.counters = IndexCounters()

    # -- queries -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def entries(self) -> list[CacheEntry]:
        return list(self._entries.values())

    def get(self, entry_id: int) -> CacheEntry | None:
        return self._entries.get(entry_id)

    def hashes(self, key: PromptKey) -> list[bytes]:
        return chain_hashes(key.canonical, self.block_size, self.namespace)

    def _candidates(self, hashes: list[bytes]) -> list[tuple[int, int]]:
        """(canonical blocks shared, entry id), deepest chain first."""
        depth = 0
        while depth < len(hashes) and hashes[depth] in self._by_hash:
            depth += 1
        seen: set[int] = set()
        out: list[tuple[int, int]] = []
        for d in range(depth, 0, -1):
            for entry_id in sorted(self._by_hash[hashes[d - 1]], reverse=True):
                if entry_id not in seen:
                    seen.add(entry_id)
                    out.append((d, entry_id))
            if len(out) >= MAX_CANDIDATES:
                break
        return out[:MAX_CANDIDATES]

    def lookup(
        self,
        key: PromptKey,
        session_candidates: Iterable[int] = (),
        promised: int = 0,
        acquire: bool = True,
        max_growth: int | None = None,
    ) -> Lookup:
        """The deepest reusable entry for ``key``. The block-hash chain is searched
        first; when it reuses less than ``promised`` tokens (what the session
        layer says the unchanged messages cover), the session's own entries are
        tried too. ``max_growth`` bounds how many more KV positions than prompt
        tokens a hit may hold (stale volatile values longer than the current
        ones): the request's admitted KV reservation must still cover it. An
        acquired hit must be ``release``d."""
        self.expire()
        self.counters.lookups += 1
        self.counters.tokens_queried += len(key.model_tokens)
        result = Lookup()
        best = self._best(self._candidates(self.hashes(key)), key, result, max_growth)
        reused = best.alignment.request_depth if best else 0
        if reused < min(promised, len(key.model_tokens) - 1):
            extra = [(0, e) for e in session_candidates if e in self._entries]
            deeper = self._best(extra, key, result, max_growth)
            if deeper is not None and deeper.alignment.request_depth > reused:
                best = deeper
                result.layer = "session"
        if best is None:
            self.counters.misses += 1
            return result
        result.hit = best
        entry = best.entry
        entry.hits += 1
        entry.last_used = self._clock()
        if acquire:
            entry.refs += 1
        self.counters.hits += 1
        if result.layer == "session":
            self.counters.session_hits += 1
        self.counters.tokens_reused += best.alignment.request_depth
        self.counters.stale_volatile_reuse += best.alignment.stale_tokens
        return result

    def _best(
        self,
        candidates: list[tuple[int, int]],
        key: PromptKey,
        result: Lookup,
        max_growth: int | None,
    ) -> CacheHit | None:
        skip = self.policy is VolatilePolicy.REUSE
        best: CacheHit | None = None
        for blocks, entry_id in candidates:
            entry = self._entries[entry_id]
            result.candidates += 1
            al = align(entry.key, key, skip_volatile=skip)
            if skip and blocks:
                self._check_key_agreement(entry, key, al, blocks, result)
            growth = al.entry_depth - al.request_depth
            if max_growth is not None and growth > max_growth:
                result.rejected.append(f"entry {entry_id}: stale values {growth} tokens longer")
                al = align(entry.key, key, skip_volatile=False)
            if not entry.trimmable and al.entry_depth != entry.length:
                # recurrent / hybrid layers cannot be cut back: whole entries only
                self.counters.hybrid_trim_miss += 1
                result.rejected.append(f"entry {entry_id}: untrimmable, matches {al.entry_depth}")
                continue
            if al.request_depth == 0:
                continue
            if best is None or al.request_depth > best.alignment.request_depth:
                best = CacheHit(entry, al)
        return best

    def _check_key_agreement(
        self, entry: CacheEntry, key: PromptKey, al: Alignment, blocks: int, result: Lookup
    ) -> None:
        """Equal cache keys must mean equal model tokens outside volatile spans: a
        model-space alignment shorter than the canonical match is a rule bug."""
        canon_match = blocks * self.block_size
        reached = key.canonical_position(al.request_depth)
        limit = min(canon_match, len(key.canonical) - 1, len(entry.key.canonical))
        if reached < limit and al.request_depth < len(key.model_tokens) - 1:
            # the span-aware alignment may legitimately stop inside a span at the
            # request's end; anything else is a disagreement
            inside_span = any(s.start <= al.request_depth < s.end for s in key.spans)
            if not inside_span:
                self.counters.exact_key_rejected_by_model_lcp += 1
                result.rejected.append(
                    f"entry {entry.entry_id}: key matched {canon_match} but model tokens "
                    f"agree only to {al.request_depth}"
                )

    def release(self, entry_id: int) -> None:
        entry = self._entries.get(entry_id)
        if entry is not None and entry.refs > 0:
            entry.refs -= 1
            if entry.refs == 0 and entry.superseded:
                self.counters.superseded += 1
                self.remove(entry_id)

    # -- updates -------------------------------------------------------------
    def insert(
        self, key: PromptKey, nbytes: int, trimmable: bool, session: str | None = None
    ) -> int | None:
        """Index a new payload; returns its id, or None if it is not worth keeping
        or cannot fit (the caller then drops the payload)."""
        self.expire()
        if len(key.model_tokens) < self.block_size or nbytes > self.max_bytes:
            return None
        for entry in self._entries.values():
            if entry.key.model_tokens == key.model_tokens or (
                trimmable and entry.trimmable and _strict_prefix(key, entry.key)
            ):
                entry.last_used = self._clock()
                return None  # already cached, or served by a longer entry
        hashes = self.hashes(key)
        if trimmable:
            self._remove_prefixes_of(key, hashes)
        if not self._make_room(nbytes):
            return None
        now = self._clock()
        entry_id = self._next_id
        self._next_id += 1
        entry = CacheEntry(entry_id, key, nbytes, trimmable, hashes, session, now, now)
        self._entries[entry_id] = entry
        for h in hashes:
            self._by_hash.setdefault(h, set()).add(entry_id)
        self.nbytes += nbytes
        self.counters.inserts += 1
        return entry_id

    def _remove_prefixes_of(self, key: PromptKey, hashes: list[bytes]) -> None:
        """A longer trimmable entry can serve every strict prefix of itself: keep it, drop them."""
        if not hashes:
            return
        for entry_id in list(self._by_hash.get(hashes[0], ())):
            entry = self._entries[entry_id]
            if entry.trimmable and _strict_prefix(entry.key, key):
                if entry.refs:  # being read right now: goes when released
                    entry.superseded = True
                    continue
                self.counters.superseded += 1
                self.remove(entry_id)

    def _make_room(self, nbytes: int) -> bool:
        while self.nbytes + nbytes > self.max_bytes or len(self._entries) >= self.max_entries:
            victim = self._victim()
            if victim is None:
                return False
            self.counters.evictions += 1
            self.remove(victim)
        return True

    def eviction_score(self, entry: CacheEntry, now: float) -> float:
        """Higher is evicted first: old, short, rarely reused branches go before
        long, hot prefixes (a long prefix costs the most to recompute)."""
        age = max(now - entry.last_used, 1e-3)
        return age / (math.sqrt(max(entry.length, 1)) * math.log(math.e + entry.hits))

    def _victim(self) -> int | None:
        now = self._clock()
        idle = [e for e in self._entries.values() if e.refs == 0]
        if not idle:
            return None
        return max(idle, key=lambda e: (self.eviction_score(e, now), -e.entry_id)).entry_id

    def expire(self) -> int:
        if self.ttl_s <= 0:
            return 0
        cutoff = self._clock() - self.ttl_s
        old = [e.entry_id for e in self._entries.values() if e.refs == 0 and e.last_used < cutoff]
        for entry_id in old:
            self.counters.expired += 1
            self.remove(entry_id)
        return len(old)

    def remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return
        for h in entry.hashes:
            ids = self._by_hash.get(h)
            if ids is not None:
                ids.discard(entry_id)
                if not ids:
                    del self._by_hash[h]
        self.nbytes -= entry.nbytes
        self._on_remove(entry_id)

    def clear(self) -> None:
        for entry_id in list(self._entries):
            self.remove(entry_id)
