"""Global prefix-cache index: block-hash chains over cache-key tokens, two tiers.

Pure bookkeeping (no MLX): each entry stands for KV the engine keeps under the
same id. Cache-key tokens are split into fixed blocks whose hashes are chained,
so one dict lookup per block walks the request's chain to the deepest depth any
entry shares. The candidates found there are then aligned in model-token space
(``prompt_key.align``), which alone decides how much KV is reused; the deepest
accepted alignment wins.

Each entry lives in RAM, on disk, or both. Its bytes are counted per tier by a
``TierLedger`` (shared KV blocks once per tier). RAM eviction demotes an entry
whose KV is on disk (or being written) instead of dropping it; a disk hit is
promoted back. The listener hears which entries left which tier and which
blocks no entry there uses any more, so the payload side frees exactly those.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Iterator

from kvcache.blocks import EntryBytes, TierLedger
from kvcache.entries import (
    CacheEntry,
    CacheHit,
    IndexCounters,
    Lookup,
    NoListener,
    PromptCacheConfig,
    TierListener,
    VolatilePolicy,
)
from kvcache.eviction import EVICTION_POLICIES, EvictionPolicy
from kvcache.image_ids import image_start
from kvcache.prompt_key import Alignment, PromptKey, align, chain_hashes

# the index's data types are imported from here by callers that use the index
__all__ = [
    "MAX_CANDIDATES",
    "CacheEntry",
    "CacheHit",
    "IndexCounters",
    "Lookup",
    "PrefixIndex",
    "PromptCacheConfig",
    "TierListener",
    "VolatilePolicy",
]

MAX_CANDIDATES = 16


def _strict_prefix(short: PromptKey, long: PromptKey) -> bool:
    """``short``'s model tokens are a strict prefix of ``long``'s."""
    n = len(short.model_tokens)
    return n < len(long.model_tokens) and long.model_tokens[:n] == short.model_tokens


def _chain_depth(hashes: list[bytes], chains: dict[bytes, set[int]]) -> int:
    """How many leading blocks of a chain some entry in ``chains`` holds."""
    depth = 0
    while depth < len(hashes) and hashes[depth] in chains:
        depth += 1
    return depth


def _discard(index: dict[bytes, set[int]], h: bytes, entry_id: int) -> None:
    ids = index.get(h)
    if ids is not None:
        ids.discard(entry_id)
        if not ids:
            del index[h]


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
        listener: TierListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        disk_bytes: int = 0,
        eviction: str | EvictionPolicy = "cost-aware",
    ):
        if block_size < 1:
            raise ValueError("block size must be >= 1")
        self.max_entries = max_entries
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.namespace = namespace
        self.policy = policy
        self.eviction = EVICTION_POLICIES[eviction] if isinstance(eviction, str) else eviction
        self.listener: TierListener = listener or NoListener()
        self._clock = clock
        self._entries: dict[int, CacheEntry] = {}
        # block hash -> the entries whose chains hold it: trimmable entries (any
        # depth of theirs can be served) and whole-only ones (recurrent layers)
        # apart, so a lookup never scans the one kind for the other
        self._by_hash: dict[bytes, set[int]] = {}
        self._whole_by_hash: dict[bytes, set[int]] = {}
        # whole-only entries by their last block's hash: the only depth they serve
        self._whole_by_tail: dict[bytes, set[int]] = {}
        self._next_id = 1
        self._ram_entries = 0
        self.ram = TierLedger(max_bytes)
        self.disk = TierLedger(disk_bytes)  # max_bytes 0: no disk tier
        self.counters = IndexCounters()

    # -- queries -------------------------------------------------------------
    @property
    def max_bytes(self) -> int:
        return self.ram.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self.ram.max_bytes = value

    @property
    def nbytes(self) -> int:
        """Bytes held in RAM (shared blocks once)."""
        return self.ram.nbytes

    @property
    def disk_enabled(self) -> bool:
        return self.disk.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def entries(self) -> list[CacheEntry]:
        return list(self._entries.values())

    def ram_entries(self) -> int:
        return self._ram_entries

    def get(self, entry_id: int) -> CacheEntry | None:
        return self._entries.get(entry_id)

    def hashes(self, key: PromptKey, variant: str = "") -> list[bytes]:
        """The key's block chain in ``variant``'s own namespace: entries of another
        precision or adapter never share a chain with it, so a lookup never walks
        past them."""
        namespace = f"{self.namespace}|{variant}" if variant else self.namespace
        return chain_hashes(key.canonical, self.block_size, namespace)

    def _candidates(
        self, key: PromptKey, result: Lookup, variant: str = ""
    ) -> list[tuple[int, int]]:
        """(canonical blocks shared, entry id), deepest chain first, of entries
        stored as ``variant`` (KV of another precision is never handed out).

        An untrimmable entry hits only whole: one whose tokens go on past the
        shared blocks cannot, and is no candidate. Every conversation's turns share
        the system prompt's blocks, and sixteen of them filled the candidates
        ahead of the system prompt's own checkpoint, the one entry that could hit.
        Whole ones are found by their last block (sorting every bucket of the
        shared system prompt, once per block of it, cost 25 ms at 2,000 entries)."""
        hashes = self.hashes(key, variant)
        whole_depth = _chain_depth(hashes, self._whole_by_hash)
        depth = max(_chain_depth(hashes, self._by_hash), whole_depth)
        self._note_uncut(key, hashes, whole_depth, result, variant)
        seen: set[int] = set()
        out: list[tuple[int, int]] = []
        for d in range(depth, 0, -1):
            here = itertools.chain(
                self._by_hash.get(hashes[d - 1], ()), self._whole_by_tail.get(hashes[d - 1], ())
            )
            for entry_id in sorted(here, reverse=True):
                entry = self._entries[entry_id]
                if entry_id in seen or not entry.loadable or entry.variant != variant:
                    continue
                seen.add(entry_id)
                out.append((d, entry_id))
            if len(out) >= MAX_CANDIDATES:
                break
        return out[:MAX_CANDIDATES]

    def _note_uncut(
        self, key: PromptKey, hashes: list[bytes], depth: int, result: Lookup, variant: str
    ) -> None:
        """How much an untrimmable entry going on past the blocks it shares would
        have served, cut back (``hybrid_trim_miss``). The deepest such entries
        share the most, so one depth's bucket is read, not one per block."""
        ours = key.canonical
        for d in range(depth, 0, -1):
            found = False
            for entry_id in self._whole_by_hash[hashes[d - 1]]:
                entry = self._entries[entry_id]
                theirs = entry.key.canonical
                if (
                    not entry.loadable
                    or entry.variant != variant
                    or len(entry.hashes) <= d  # whole within the shared blocks: a candidate
                    or (d < len(hashes) and entry.hashes[d] == hashes[d])  # shares more
                ):
                    continue
                found = True
                shared, end = d * self.block_size, min(len(ours), len(theirs))
                while shared < end and ours[shared] == theirs[shared]:
                    shared += 1  # within one block: they differ by its end
                result.uncut_depth = max(result.uncut_depth, shared)
            if found:
                return

    def lookup(
        self,
        key: PromptKey,
        session_candidates: Iterable[int] = (),
        promised: int = 0,
        acquire: bool = True,
        max_growth: int | None = None,
        variant: str = "",
        count_hit: bool = True,
        session: str | None = None,
    ) -> Lookup:
        """The deepest reusable entry for ``key``. The block-hash chain is searched
        first; when it reuses less than ``promised`` tokens (what the session
        layer says the unchanged messages cover), the session's own entries are
        tried too. ``max_growth`` bounds how many more KV positions than prompt
        tokens a hit may hold (stale volatile values longer than the current
        ones): the request's admitted KV reservation must still cover it. An
        acquired hit must be ``release``d; a hit on disk is ``promote``d by the
        caller once its KV is loaded. ``count_hit=False``: the caller reads the KV
        first, then counts the hit (``served``) or the miss (``unusable_hit``), so
        the hit counters never count one they must take back (a scrape between saw
        a Prometheus counter go down: a reset, and a spike in every rate)."""
        self.expire()
        self.counters.lookups += 1
        self.counters.tokens_queried += len(key.model_tokens)
        result = Lookup()
        candidates = self._candidates(key, result, variant)
        best = self._best(candidates, key, result, max_growth, session)
        reused = best.alignment.request_depth if best else 0
        if reused < min(promised, len(key.model_tokens) - 1):
            extra = [
                (0, e)
                for e in session_candidates
                if e in self._entries
                and e not in result.judged
                and self._entries[e].loadable
                and not self._entries[e].forgotten
                and self._entries[e].variant == variant
            ]
            deeper = self._best(extra, key, result, max_growth, session)
            if deeper is not None and deeper.alignment.request_depth > reused:
                best = deeper
                result.layer = "session"
        if result.uncut_depth > (best.alignment.request_depth if best else 0):
            # once per lookup, and only where cutting would have reused more: a new
            # conversation sharing a system prompt with others is clean traffic
            self.counters.hybrid_trim_miss += 1
        if best is None:
            self.counters.misses += 1
            return result
        result.hit = best
        entry = best.entry
        result.tier = "ram" if entry.in_ram else "disk"
        entry.hits += 1
        entry.last_used = self._clock()
        if acquire:
            entry.refs += 1
        if count_hit:
            self.served(result)
        return result

    def unusable_hit(self, result: Lookup) -> None:
        """The hit a ``count_hit=False`` lookup chose served nothing (its KV could
        not be read back): it counts as the miss the client saw."""
        self.counters.misses += 1

    def served(self, result: Lookup) -> None:
        """Count the hit ``lookup`` chose: its KV reached the request."""
        assert result.hit is not None
        entry, al = result.hit.entry, result.hit.alignment
        c = self.counters
        if entry.entry_id in result.retreated:
            c.vlm_retreat += 1
        c.hits += 1
        if result.layer == "session":
            c.session_hits += 1
        if result.tier == "disk":
            c.disk_hits += 1
            c.disk_tokens_reused += al.request_depth
        c.tokens_reused += al.request_depth
        c.stale_volatile_reuse += al.stale_tokens

    def _best(
        self,
        candidates: list[tuple[int, int]],
        key: PromptKey,
        result: Lookup,
        max_growth: int | None,
        session: str | None = None,
    ) -> CacheHit | None:
        skip = self.policy is VolatilePolicy.REUSE
        best: CacheHit | None = None
        for blocks, entry_id in candidates:
            entry = self._entries[entry_id]
            result.candidates += 1
            result.judged.add(entry_id)
            # a reminder only the entry has was read by its own conversation (``session``:
            # a conversation's own id, CacheHints.own_conversation); another
            # conversation's is never read by this one
            own = session is not None and entry.own_session and entry.session == session
            # the row's reserved KV covers at most ``max_growth`` positions more than
            # its prompt: the alignment keeps to that bound
            al = align(
                entry.key, key, skip_volatile=skip, entry_only_read=own, max_growth=max_growth
            )
            if al.capped:
                result.rejected.append(
                    f"entry {entry_id}: stale values past the reserved KV, "
                    f"reused to {al.request_depth}"
                )
            elif skip and blocks:  # a capped alignment stops short of the key's match
                self._check_key_agreement(entry, key, al, blocks, result)
            al = self._before_partial_image(key, al, entry_id, result)
            if not entry.trimmable and al.entry_depth != entry.length:
                # recurrent / hybrid layers cannot be cut back: whole entries only
                result.uncut_depth = max(result.uncut_depth, al.request_depth)
                result.rejected.append(f"entry {entry_id}: untrimmable, matches {al.entry_depth}")
                continue
            if al.request_depth == 0:
                continue
            better = best is None or al.request_depth > best.alignment.request_depth
            # at equal depth, KV already in RAM beats KV to be read from disk
            tie_in_ram = (
                best is not None
                and al.request_depth == best.alignment.request_depth
                and entry.in_ram
                and not best.entry.in_ram
            )
            if better or tie_in_ram:
                best = CacheHit(entry, al)
        return best

    @staticmethod
    def _before_partial_image(
        key: PromptKey, al: Alignment, entry_id: int, result: Lookup
    ) -> Alignment:
        """A hit that ends inside an image (both sides hold the same image there)
        retreats to its start: the vision tower's features come whole."""
        start = image_start(key.model_tokens, al.request_depth)
        if start == al.request_depth:
            return al
        result.retreated.add(entry_id)
        cut = al.request_depth - start
        return Alignment(al.entry_depth - cut, start, al.stale_tokens)

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
            if entry.refs == 0 and entry.forgotten:
                self.remove(entry_id)
            elif entry.refs == 0 and entry.superseded and not entry.pinned:
                self.counters.superseded += 1
                self.remove(entry_id)

    # -- updates -------------------------------------------------------------
    def insert(
        self,
        key: PromptKey,
        nbytes: int | EntryBytes,
        trimmable: bool,
        session: str | None = None,
        variant: str = "",
        persist: bool = False,
        own_session: bool = False,
    ) -> int | None:
        """Index a new payload in RAM; returns its id, or None if it is not worth
        keeping or cannot fit (the caller then drops the payload). ``persist``
        reserves its disk bytes too (``begin_persist``) before the shorter entries
        it supersedes go, so the blocks they share never leave the disk only to be
        written again."""
        self.expire()
        held = nbytes if isinstance(nbytes, EntryBytes) else EntryBytes(private=nbytes)
        # a key of less than one block has no block hash to be found by (dropped
        # spans can leave that of many model tokens)
        if len(key.canonical) < self.block_size or held.total > self.ram.max_bytes:
            return None
        hashes = self.hashes(key, variant)
        # one that holds every full block of this key is the only one that can equal
        # it or serve it (not a scan of every entry's tokens, per store). Only if
        # its KV can be had now: one left RAM with its write still queued would
        # miss every lookup until written, and lose this KV too if the write failed
        twin_written = False
        for entry_id in itertools.chain(
            self._by_hash.get(hashes[-1], ()), self._whole_by_hash.get(hashes[-1], ())
        ):
            entry = self._entries[entry_id]
            if entry.variant != variant:
                continue
            if entry.key.model_tokens == key.model_tokens:
                if not entry.loadable:
                    twin_written = twin_written or entry.persisting
                    continue
                entry.last_used = self._clock()
                # wanted again: the longer entry that superseded it may be gone
                entry.superseded = False
                return None  # already cached
            if trimmable and entry.trimmable and entry.loadable and _strict_prefix(key, entry.key):
                entry.last_used = self._clock()
                return None  # served by a longer entry
        covered = self._prefixes_of(key, hashes, variant) if trimmable else []
        idle = [e for e in covered if not e.refs]
        if not self._make_room(held, spare=sum(1 for e in idle if e.in_ram), keep=idle):
            # no room beside them: drop them first after all (their shared blocks go too)
            for old in idle:
                self.counters.superseded += 1
                self.remove(old.entry_id)
            if not self._make_room(held):
                return None
        entry = self._new_entry(
            key, held, trimmable, hashes, session, variant=variant, own_session=own_session
        )
        self.ram.add(held)
        self._ram_entries += 1
        self.counters.inserts += 1
        if persist and not twin_written:  # an equal entry's write is under way
            self.begin_persist(entry.entry_id)
        for old in covered:  # a longer trimmable entry serves every strict prefix of itself
            if old.refs:  # being read right now: goes when released
                old.superseded = True
            elif old.entry_id in self._entries:
                self.counters.superseded += 1
                self.remove(old.entry_id)
        return entry.entry_id

    def _new_entry(
        self,
        key: PromptKey,
        held: EntryBytes,
        trimmable: bool,
        hashes: list[bytes],
        session: str | None,
        **state: object,
    ) -> CacheEntry:
        now = self._clock()
        entry_id = self._next_id
        self._next_id += 1
        entry = CacheEntry(
            entry_id, key, held, trimmable, hashes, session, now, now, stored_at=time.time()
        )
        for name, value in state.items():
            setattr(entry, name, value)
        self._entries[entry_id] = entry
        chains = self._by_hash if trimmable else self._whole_by_hash
        for h in hashes:
            chains.setdefault(h, set()).add(entry_id)
        if not trimmable and hashes:
            self._whole_by_tail.setdefault(hashes[-1], set()).add(entry_id)
        return entry

    def restore(
        self,
        key: PromptKey,
        held: EntryBytes,
        trimmable: bool,
        session: str | None,
        uid: str,
        pinned: bool = False,
        variant: str = "",
        own_session: bool = False,
        stored_at: float = 0.0,
    ) -> int | None:
        """Index an entry found on disk at start (not in RAM); None if the disk
        tier has no room for it (the caller deletes its files)."""
        if not self.disk.fits(held):
            return None
        entry = self._new_entry(
            key,
            held,
            trimmable,
            self.hashes(key, variant),
            session,
            uid=uid,
            in_ram=False,
            on_disk=True,
            pinned=pinned,
            variant=variant,
            own_session=own_session,
            stored_at=stored_at,
        )
        self.disk.add(held)
        return entry.entry_id

    def _prefixes_of(self, key: PromptKey, hashes: list[bytes], variant: str) -> list[CacheEntry]:
        """Trimmable entries of this variant whose tokens are a strict prefix of ``key``'s.
        Tokens are compared only where the entry's last block hash is the key's at
        that depth (chained: all its blocks agree), not for every entry sharing the
        first block (95 ms per store among 1,500 long entries of one tree)."""
        if not hashes:
            return []
        out = []
        for entry_id in self._by_hash.get(hashes[0], ()):
            entry = self._entries[entry_id]
            n = len(entry.hashes)
            if (
                n <= len(hashes)
                and entry.hashes[-1] == hashes[n - 1]
                and not entry.pinned
                and entry.variant == variant
                and _strict_prefix(entry.key, key)
            ):
                out.append(entry)
        return out

    def _make_room(
        self, held: EntryBytes, spare: int = 0, keep: list[CacheEntry] | None = None
    ) -> bool:
        """Evict (or demote to disk) RAM entries until ``held`` fits; ``spare`` RAM
        entries (``keep``) are about to go anyway and are not victims."""
        kept = {e.entry_id for e in keep or ()}
        victims = self._victims(
            # a saved entry stays until written: were its write to fail, RAM holds the KV
            lambda e: (
                e.in_ram
                and e.entry_id not in kept
                and not e.holds_queue
                and not (e.pinned and e.persisting)
            )
        )
        while not self.ram.fits(held) or self._ram_entries - spare >= self.max_entries:
            victim = next(victims, None)
            if victim is None:
                return False
            self._leave_ram(victim)
        return True

    def _leave_ram(self, entry: CacheEntry) -> None:
        if entry.on_disk or entry.persisting:
            self.counters.demotions += 1
            self._drop_ram(entry)
        else:
            self.counters.evictions += 1
            self.remove(entry.entry_id)

    def _drop_ram(self, entry: CacheEntry) -> None:
        entry.in_ram = False
        self._ram_entries -= 1
        self.listener.left_ram(entry, self.ram.remove(entry.held))

    def _drop_disk(self, entry: CacheEntry) -> None:
        entry.on_disk = entry.persisting = False
        self.listener.left_disk(entry, self.disk.remove(entry.held))

    def eviction_score(self, entry: CacheEntry, now: float) -> float:
        """Higher is evicted first (the configured policy)."""
        return self.eviction.score(entry, now)

    def _victims(self, where: Callable[[CacheEntry], bool]) -> Iterator[CacheEntry]:
        """Idle entries ``where`` accepts, highest score first (the older on a tie),
        each checked again when its turn comes. Every entry is scored once, on the
        first ``next``: a scan per victim cost entries x victims (18.7 s on the
        engine thread to make room for one large entry among 10,000 on disk)."""
        now = self._clock()
        heap = [
            (-self.eviction_score(e, now), e.entry_id, e)  # ids differ: e is never compared
            for e in self._entries.values()
            if e.refs == 0 and where(e)
        ]
        heapq.heapify(heap)
        while heap:
            _, entry_id, entry = heapq.heappop(heap)
            if self._entries.get(entry_id) is entry and entry.refs == 0 and where(entry):
                yield entry

    # -- the disk tier -------------------------------------------------------
    def begin_persist(self, entry_id: int) -> bool:
        """Reserve disk bytes for an entry about to be written (evicting disk
        entries to make room); False if it cannot fit."""
        entry = self._entries.get(entry_id)
        if entry is None or not self.disk_enabled or entry.on_disk or entry.persisting:
            return False
        if self.disk.max_bytes < entry.held.total:
            return False
        victims = self._victims(lambda e: e.on_disk and not e.pinned and e.entry_id != entry_id)
        while not self.disk.fits(entry.held):
            victim = next(victims, None)
            if victim is None:
                return False
            self.counters.disk_evictions += 1
            if victim.in_ram:
                self._drop_disk(victim)
            else:
                self.remove(victim.entry_id)
        self.disk.add(entry.held)
        entry.persisting = True
        entry.writes += 1
        return True

    def end_persist(self, entry_id: int, ok: bool, write: int | None = None) -> CacheEntry | None:
        """The write of an entry finished (or failed: its reservation is returned);
        ``write``: which of its writes (``CacheEntry.writes``), None for the latest.
        Returns the entry if this write failed (gone from the index unless in RAM)."""
        entry = self._entries.get(entry_id)
        if entry is None or not entry.persisting:
            return None
        if write is not None and write != entry.writes:
            return None  # an earlier write, dropped while queued: its files are deleted
        entry.holds_queue = False
        if ok:
            entry.persisting = False
            entry.on_disk = True
            return None
        self._drop_disk(entry)
        if not entry.in_ram:
            self.remove(entry_id)
        return entry

    def lose_block(self, digest: bytes) -> int:
        """A block's file was found damaged: every disk copy naming it goes (an
        entry also in RAM stays there), so the file is deleted once none names it
        and the next entry holding those tokens writes it afresh. Only the entry
        read went before: the others kept the bad file, and new entries were
        written pointing at it, across restarts."""
        named = [
            e
            for e in self._entries.values()
            if (e.on_disk or e.persisting) and any(d == digest for d, _ in e.held.blocks)
        ]
        for entry in named:
            entry.holds_queue = False  # its write's end finds it no longer persisting
            if entry.in_ram:
                self._drop_disk(entry)
            else:
                self.remove(entry.entry_id)
        return len(named)

    def promote(self, entry_id: int) -> bool:
        """Count a disk entry back into RAM once its KV is loaded; False if RAM has
        no room (the caller uses the loaded KV once and lets it go)."""
        entry = self._entries.get(entry_id)
        if entry is None or entry.in_ram:
            return entry is not None
        if entry.held.total > self.ram.max_bytes or not self._make_room(entry.held):
            return False
        self.ram.add(entry.held)
        entry.in_ram = True
        self._ram_entries += 1
        self.counters.promotions += 1
        return True

    def set_pinned(self, entry_id: int, pinned: bool) -> None:
        entry = self._entries.get(entry_id)
        if entry is not None:
            entry.pinned = pinned
            if pinned:  # saved: a longer entry serving its tokens no longer retires it
                entry.superseded = False

    def expire(self) -> int:
        if self.ttl_s <= 0:
            return 0
        cutoff = self._clock() - self.ttl_s
        old = [
            e.entry_id
            for e in self._entries.values()
            if e.refs == 0 and not e.pinned and e.last_used < cutoff
        ]
        for entry_id in old:
            self.counters.expired += 1
            self.remove(entry_id)
        return len(old)

    def forget(self, entry_id: int) -> None:
        """Its conversation was deleted: it goes now, or, while a turn still reads
        it, leaves every lookup and the disk now (a restart must not bring it back)
        and RAM on ``release`` (the reader holds those arrays). Marked only, it was
        still served to new requests, and restored from disk after a crash."""
        entry = self._entries.get(entry_id)
        if entry is None:
            return
        entry.pinned = False
        if entry.refs == 0:
            self.remove(entry_id)
            return
        entry.forgotten = True
        self._unhash(entry)
        if entry.on_disk or entry.persisting:
            entry.holds_queue = False  # its write's end finds it no longer persisting
            self._drop_disk(entry)
        if not entry.in_ram:  # read from disk with no room in RAM: the reader has it all
            self.remove(entry_id)

    def _unhash(self, entry: CacheEntry) -> None:
        """No block chain leads to ``entry`` any more."""
        chains = self._by_hash if entry.trimmable else self._whole_by_hash
        for h in entry.hashes:
            _discard(chains, h, entry.entry_id)
        if not entry.trimmable and entry.hashes:
            _discard(self._whole_by_tail, entry.hashes[-1], entry.entry_id)

    def remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return
        self._unhash(entry)
        if entry.in_ram:
            self._drop_ram(entry)
        if entry.on_disk or entry.persisting:
            self._drop_disk(entry)

    def clear(self) -> None:
        for entry_id in list(self._entries):
            self.remove(entry_id)
