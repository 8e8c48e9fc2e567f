"""The block-hash index against a brute-force reference (hypothesis state machine)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.blocks import EntryBytes, block_digests
from kvcache.eviction import EVICTION_POLICIES
from kvcache.index import MAX_CANDIDATES, PrefixIndex, VolatilePolicy
from kvcache.prompt_key import PromptKey, TokenSpan, align, chain_hashes
from kvcache.volatile_rules import RULE_INDEX
from tests.unit.test_prompt_key import outside_spans

TS = RULE_INDEX["timestamp"]
BLOCK = 2


@st.composite
def keys(draw):
    """Prompts built from a few shared stems so that prefixes collide often."""
    stem = draw(st.sampled_from([[1, 2, 3, 4], [1, 2, 5, 6], [8, 8, 8, 8]]))
    tokens = list(stem)
    spans = []
    if draw(st.booleans()):
        value = draw(st.lists(st.integers(20, 22), min_size=1, max_size=3))
        spans.append(TokenSpan(len(tokens), len(tokens) + len(value), TS))
        tokens += value
    tokens += draw(st.lists(st.integers(0, 3), min_size=1, max_size=8))
    return PromptKey.build(tokens, spans)


KV_BLOCK = 2  # model tokens per stored block; 1 byte per token


def held_for(key: PromptKey) -> EntryBytes:
    digests = block_digests(key.model_tokens, KV_BLOCK, "m")
    return EntryBytes(tuple((d, KV_BLOCK) for d in digests), len(key.model_tokens) % KV_BLOCK)


class Listener:
    """Checks, at the moment a tier frees blocks, that no entry there still uses them."""

    def __init__(self, machine):
        self.machine = machine

    def _users(self, tier):
        index = self.machine.index
        for e in index.entries():
            here = e.in_ram if tier == "ram" else (e.on_disk or e.persisting)
            if here:
                yield from (d for d, _ in e.held.blocks)

    def left_ram(self, entry, freed):
        assert not entry.in_ram
        assert not set(freed) & set(self._users("ram"))

    def left_disk(self, entry, freed):
        assert not (entry.on_disk or entry.persisting)
        assert not set(freed) & set(self._users("disk"))


class IndexMachine(RuleBasedStateMachine):
    """The tiered, block-shared index against brute-force references."""

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.index = PrefixIndex(
            max_bytes=24,
            max_entries=6,
            block_size=BLOCK,
            ttl_s=50.0,
            namespace="m",
            policy=VolatilePolicy.REUSE,
            listener=Listener(self),
            clock=lambda: self.now,
            disk_bytes=40,
        )
        self.in_use: dict[int, int] = {}  # entry id -> acquired count
        self.forgotten: set[int] = set()  # deleted while read: may go before released
        self.kept_beside: set[tuple[int, int]] = set()  # (short, long) stored while long unread

    @rule(key=keys(), trimmable=st.booleans(), persist=st.booleans())
    def insert(self, key, trimmable, persist):
        # longer entries whose KV cannot be had now (their write still queued) do
        # not serve this key: it is kept beside them
        unreadable = [
            e.entry_id
            for e in self.index.entries()
            if not e.loadable and e.key.model_tokens[: len(key.model_tokens)] == key.model_tokens
        ]
        entry_id = self.index.insert(key, held_for(key), trimmable=trimmable)
        if entry_id is not None:
            self.kept_beside.update((entry_id, long_id) for long_id in unreadable)
        if entry_id is not None and persist:
            self.index.begin_persist(entry_id)

    @precondition(lambda self: any(e.persisting for e in self.index.entries()))
    @rule(data=st.data(), ok=st.booleans())
    def write_finishes(self, data, ok):
        pending = sorted(e.entry_id for e in self.index.entries() if e.persisting)
        self.index.end_persist(data.draw(st.sampled_from(pending)), ok)

    @rule(key=keys())
    def lookup(self, key):
        self.index.expire()  # lookup expires first: the reference must see the same entries
        candidates = [
            e
            for e in self.index.entries()
            if e.loadable
            and not e.forgotten
            and chain_hashes(e.key.canonical, BLOCK, "m")[:1]
            and chain_hashes(e.key.canonical, BLOCK, "m")[0]
            == (chain_hashes(key.canonical, BLOCK, "m") or [None])[0]
        ]
        result = self.index.lookup(key)
        # reference: the deepest acceptable alignment among entries sharing a block
        best = 0
        for e in candidates:
            al = align(e.key, key, skip_volatile=True)
            if not e.trimmable and al.entry_depth != e.length:
                continue
            best = max(best, al.request_depth)
        if result.hit is None:
            assert best == 0 or len(candidates) > MAX_CANDIDATES
            return
        al = result.hit.alignment
        entry = result.hit.entry
        # never a wrong hit: equal outside volatile spans up to the reuse point
        assert outside_spans(entry.key, al.entry_depth) == outside_spans(key, al.request_depth)
        assert al.request_depth <= len(key.model_tokens) - 1
        if not entry.trimmable:
            assert al.entry_depth == entry.length
        if len(candidates) <= MAX_CANDIDATES:
            assert al.request_depth == best  # the deepest entry wins
        # the blocks handed out are those of the tokens the KV stands for, and
        # where no volatile span intervenes, of the request's own tokens
        own = block_digests(entry.key.model_tokens, KV_BLOCK, "m")
        assert [d for d, _ in entry.held.blocks] == own
        clean = min([s.start for s in (*entry.key.spans, *key.spans)] + [al.request_depth])
        theirs = block_digests(key.model_tokens[:clean], KV_BLOCK, "m")
        assert own[: len(theirs)] == theirs
        if not entry.in_ram:
            assert entry.on_disk  # only fully written entries are read from disk
            self.index.promote(entry.entry_id)
        self.in_use[entry.entry_id] = self.in_use.get(entry.entry_id, 0) + 1

    @precondition(lambda self: self.in_use)
    @rule(data=st.data())
    def release(self, data):
        entry_id = data.draw(st.sampled_from(sorted(self.in_use)))
        self.index.release(entry_id)
        self.in_use[entry_id] -= 1
        if not self.in_use[entry_id]:
            del self.in_use[entry_id]

    @precondition(lambda self: len(self.index))
    @rule(data=st.data())
    def forget(self, data):
        entry_id = data.draw(st.sampled_from(sorted(e.entry_id for e in self.index.entries())))
        self.index.forget(entry_id)
        self.forgotten.add(entry_id)
        entry = self.index.get(entry_id)
        assert entry is None or (entry.refs and entry.in_ram and not entry.on_disk)

    @rule(dt=st.floats(0, 30))
    def tick(self, dt):
        self.now += dt
        self.index.expire()

    def _reference(self, here):
        """Brute-force bytes of a tier: each distinct block once, plus private bytes."""
        blocks, private, refs = {}, 0, Counter()
        for e in self.index.entries():
            if here(e):
                private += e.held.private
                for d, n in e.held.blocks:
                    blocks[d] = n
                    refs[d] += 1
        return sum(blocks.values()) + private, refs

    @invariant()
    def budgets_hold_per_tier(self):
        ram, disk = self.index.ram, self.index.disk
        assert ram.nbytes <= ram.max_bytes
        assert disk.nbytes <= disk.max_bytes
        assert self.index.ram_entries() <= self.index.max_entries
        ram_bytes, ram_refs = self._reference(lambda e: e.in_ram)
        disk_bytes, disk_refs = self._reference(lambda e: e.on_disk or e.persisting)
        assert (ram.nbytes, dict(ram.refs)) == (ram_bytes, dict(ram_refs))
        assert (disk.nbytes, dict(disk.refs)) == (disk_bytes, dict(disk_refs))

    @invariant()
    def every_entry_is_somewhere(self):
        for e in self.index.entries():
            assert e.in_ram or e.on_disk or e.persisting

    @invariant()
    def entries_in_use_are_never_evicted(self):
        for entry_id in self.in_use:
            assert entry_id in self.index or entry_id in self.forgotten

    @invariant()
    def no_entry_is_a_strict_prefix_of_a_trimmable_one(self):
        entries = self.index.entries()
        for short in entries:
            if short.refs or not short.trimmable:  # in use: removed on release
                continue
            for long in entries:
                if (short.entry_id, long.entry_id) in self.kept_beside:
                    continue
                if long.trimmable and not long.forgotten and long.length > short.length:
                    assert long.key.model_tokens[: short.length] != short.key.model_tokens


IndexMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase


def _key(tokens, spans=()):
    return PromptKey.build(tokens, spans)


def test_short_entry_never_shadows_a_long_one():
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m")
    base = list(range(100, 140))
    index.insert(_key(base[:8]), 8, True)
    index.insert(_key(base[:8] + [1, 2, 3, 4]), 12, True)  # a branch: not a prefix of the next
    long_id = index.insert(_key(base[:36]), 36, True)
    hit = index.lookup(_key(base + [5])).hit
    assert hit.entry.entry_id == long_id and hit.reused == 36


def test_untrimmable_entries_only_hit_whole_and_count_misses():
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m")
    tokens = list(range(100, 120))
    index.insert(_key(tokens), 20, trimmable=False)
    assert index.lookup(_key(tokens + [1, 2])).hit.reused == 20
    assert index.counters.hybrid_trim_miss == 0
    assert index.lookup(_key(tokens[:12] + [9, 9, 9, 9, 9])).hit is None
    assert index.counters.hybrid_trim_miss == 1


def test_an_uncut_entry_is_judged_once_and_counted_once():
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m")
    tokens = list(range(100, 120))
    eid = index.insert(_key(tokens), 20, trimmable=False, session="s")
    # the session layer promises what the chain search already judged
    res = index.lookup(_key(tokens[:12] + [9] * 5), session_candidates=[eid], promised=12)
    assert res.hit is None and res.candidates == 1 and len(res.rejected) == 1
    assert index.counters.hybrid_trim_miss == 1


@pytest.mark.parametrize("others", [3, 20])  # past the 16 candidates a lookup aligns
def test_agents_sharing_a_system_prompt_on_a_recurrent_model_are_clean_traffic(others):
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m")
    system = list(range(500, 532))
    index.insert(_key(system), 32, trimmable=False, session="x")  # the checkpoint
    for i, session in enumerate(f"s{n}" for n in range(others)):
        turn = system + [1000 + 50 * i + k for k in range(20)]
        index.insert(_key(turn), 52, trimmable=False, session=session)
    # a new agent: the checkpoint serves all an ideal cache could; the others'
    # turns cannot be cut back, but cutting would not have given more
    res = index.lookup(_key(system + [900 + k for k in range(20)]))
    assert res.hit is not None and res.hit.reused == 32
    assert index.counters.hybrid_trim_miss == 0


def test_eviction_prefers_short_cold_entries_and_ttl_expires():
    now = [0.0]
    index = PrefixIndex(max_bytes=100, block_size=4, namespace="m", ttl_s=100, clock=lambda: now[0])
    long_id = index.insert(_key(list(range(200, 260))), 60, True)
    for _ in range(3):
        now[0] += 1
        index.lookup(_key(list(range(200, 260)) + [1]), acquire=False)
    now[0] += 5
    short_id = index.insert(_key(list(range(300, 320))), 20, True)
    now[0] += 5
    index.insert(_key(list(range(400, 430))), 30, True)  # needs room: the short cold one goes
    assert long_id in index and short_id not in index
    now[0] += 200
    index.expire()
    assert len(index) == 0 and index.counters.expired == 2


def test_canonical_key_disagreement_is_counted():
    """Equal cache keys but different model tokens outside spans would be a rule bug."""
    index = PrefixIndex(max_bytes=10**6, block_size=2, namespace="m")
    # fabricate keys whose canonical forms agree while the model tokens do not
    a = PromptKey(tuple([1, 2, 3, 4, 5]), (), (), 0, (1, 2, 3, 4, 5))
    b = PromptKey(tuple([1, 2, 9, 4, 5, 6]), (), (), 0, (1, 2, 3, 4, 5, 6))
    index.insert(a, 5, True)
    result = index.lookup(b)
    assert result.hit.reused == 2
    assert index.counters.exact_key_rejected_by_model_lcp == 1


def test_session_layer_finds_what_the_chain_misses_up_to_the_promise():
    """When the block chain reuses less than the session's unchanged messages
    promise, the session's own entries are aligned directly."""
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m")
    tokens = list(range(100, 140))
    # an entry whose cache key no longer chains with the request's (e.g. keyed
    # under an older rule table) while its model tokens still agree
    stale_key = PromptKey(tuple(tokens), (), (), 0, tuple(t + 1 for t in tokens))
    entry_id = index.insert(stale_key, 40, True)
    request = _key(tokens + [1, 2, 3])
    assert index.lookup(request, acquire=False).hit is None  # the chain alone misses
    result = index.lookup(request, session_candidates=[entry_id], promised=40, acquire=False)
    assert result.layer == "session" and result.hit.reused == 40
    assert index.counters.session_hits == 1
    # without a promise the session layer is not consulted
    assert index.lookup(request, session_candidates=[entry_id], promised=0).hit is None


def test_stale_values_longer_than_the_reservation_allows_fall_back_to_exact_reuse():
    ts = RULE_INDEX["timestamp"]
    index = PrefixIndex(max_bytes=10**6, block_size=2, namespace="m")
    old = PromptKey.build([1, 2, 50, 51, 52, 53, 3, 4, 5], [TokenSpan(2, 6, ts)])
    new = PromptKey.build([1, 2, 60, 3, 4, 5, 6], [TokenSpan(2, 3, ts)])
    index.insert(old, 9, True)
    assert index.lookup(new, acquire=False).hit.alignment.entry_depth == 9  # 3 more positions
    capped = index.lookup(new, acquire=False, max_growth=2)
    assert capped.hit.alignment.entry_depth == capped.hit.reused == 2  # exact prefix only


def test_stale_values_past_the_reservation_still_reuse_what_lies_before_them():
    """A changed clock on the first line, then a block only the entry holds (an
    envelope of a message the client now sends without it) longer than the
    rounding slack: the exact-prefix fallback stopped at the clock, a near-full
    hit became a near-total miss. The hit now ends where the growth would begin."""
    ts, ic = RULE_INDEX["timestamp"], RULE_INDEX["inbound_context"]
    index = PrefixIndex(max_bytes=10**6, block_size=2, namespace="m")
    stem = list(range(100, 120))
    old = PromptKey.build(
        [1, 50, *stem, 70, 71, 72, 73, 3, 4, 5], [TokenSpan(1, 2, ts), TokenSpan(22, 26, ic)]
    )
    new = PromptKey.build([1, 60, *stem, 3, 4, 5, 6], [TokenSpan(1, 2, ts)])
    index.insert(old, len(old.model_tokens), True)
    assert index.lookup(new, acquire=False).hit.alignment.entry_depth == 29  # 4 more positions
    for slack in (0, 3):
        al = index.lookup(new, acquire=False, max_growth=slack).hit.alignment
        assert (al.entry_depth, al.request_depth, al.stale_tokens) == (22, 22, 1)
    al = index.lookup(new, acquire=False, max_growth=4).hit.alignment
    assert (al.entry_depth, al.request_depth) == (29, 25)
    # stopping short of the key's match for the reservation is no rule bug
    assert index.counters.exact_key_rejected_by_model_lcp == 0


def test_a_lost_block_leaves_no_entry_held_in_ram_by_a_write_that_no_longer_counts():
    """lose_block ends a persisting entry's disk copy; its write's end then found it
    not persisting and returned before letting it go from the write queue's hold,
    so RAM eviction skipped it for good."""
    index = PrefixIndex(max_bytes=10**6, block_size=BLOCK, namespace="m", disk_bytes=10**6)
    key = _key(list(range(10, 18)))
    entry_id = index.insert(key, held_for(key), trimmable=True)
    assert index.begin_persist(entry_id)
    entry = index.get(entry_id)
    entry.holds_queue = True  # a write larger than the queue's share (the manager sets it)
    (digest, _) = entry.held.blocks[0]
    assert index.lose_block(digest) == 1
    index.end_persist(entry_id, True)
    assert entry.in_ram and not entry.on_disk and not entry.holds_queue


def test_a_key_dropped_below_one_block_is_not_kept_and_raises_nothing():
    """Droppable spans can leave a key of many model tokens less than one block of
    cache-key tokens: its insert raised IndexError (and failed the request)."""
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m")
    key = PromptKey.build(
        [1, *range(100, 140), 2], [TokenSpan(1, 41, RULE_INDEX["system_reminder"])]
    )
    assert len(key.canonical) == 2
    assert index.insert(key, 40, True) is None
    assert len(index) == 0


def test_a_superseded_entry_stored_again_outlives_its_reader():
    """A read by a turn, superseded by a longer B, B evicted, A's tokens stored
    again ("already cached"): A's reader then let go and A went, its prefix lost."""
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m", max_entries=2)
    tokens = list(range(100, 132))
    a = index.insert(_key(tokens), 32, True)
    assert index.lookup(_key(tokens + [1, 2])).hit.entry.entry_id == a  # a turn reads it
    b = index.insert(_key(tokens + list(range(200, 216))), 48, True)
    assert index.get(a).superseded
    index.insert(_key([7] * 32), 32, True)  # over max_entries: B, the idle one, goes
    assert b not in index
    assert index.insert(_key(tokens), 32, True) is None  # already cached: A
    index.release(a)
    assert a in index
    assert index.lookup(_key(tokens + [1, 2])).hit.entry.entry_id == a


def test_a_forgotten_entry_stored_again_still_goes_when_its_reader_lets_go():
    """Deleting a conversation forgets the entries a turn still reads: no lookup
    finds them (not the session layer either), the same tokens stored again are
    a new entry, and the forgotten one goes when its reader lets go."""
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m")
    tokens = list(range(100, 132))
    a = index.insert(_key(tokens), 32, True, session="S")
    assert index.lookup(_key(tokens + [1, 2])).hit.entry.entry_id == a  # a turn reads it
    index.forget(a)  # what delete_conversation does
    assert a in index and index.get(a).forgotten
    found = index.lookup(_key(tokens + [1, 2]), session_candidates=[a], promised=32)
    assert found.hit is None
    b = index.insert(_key(tokens), 32, True)
    assert b is not None and b != a
    index.release(a)
    assert a not in index
    assert index.lookup(_key(tokens + [1, 2])).hit.entry.entry_id == b


def test_a_saved_entry_is_kept_when_its_reader_lets_go_of_it_superseded():
    """Read by a turn, superseded by a longer entry (a fork), then saved: the
    reader's release deleted the saved conversation's KV, files and all."""
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m", disk_bytes=10**6)
    tokens = list(range(100, 140))
    saved = index.insert(_key(tokens), 40, True, session="A")
    assert index.lookup(_key(tokens + [1, 2])).hit.entry.entry_id == saved  # held by a turn
    index.insert(_key(list(range(100, 160))), 60, True, session="B")  # serves its tokens
    assert index.begin_persist(saved)
    index.end_persist(saved, True)
    index.set_pinned(saved, True)
    index.release(saved)
    assert saved in index and index.get(saved).pinned


class _CountedScores:
    """Cost-aware eviction that counts the entries it scores."""

    name = "counted"

    def __init__(self) -> None:
        self.scored = 0

    def score(self, entry, now):
        self.scored += 1
        return EVICTION_POLICIES["cost-aware"].score(entry, now)


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_making_room_for_a_large_entry_scores_each_entry_once(tier):
    """Each victim was chosen by scoring every entry again: making room for one
    large entry among 10,000 small ones on disk held the engine thread 18.7 s."""
    n, size = 1000, 10
    policy = _CountedScores()
    ram, disk = (n * size, 10**9) if tier == "ram" else (10**9, n * size)
    index = PrefixIndex(
        max_bytes=ram, max_entries=10**6, block_size=4, disk_bytes=disk, eviction=policy
    )
    for i in range(n):
        entry_id = index.insert(_key([i + 1] * 4 + [i]), size, True)
        assert index.begin_persist(entry_id)
        index.end_persist(entry_id, True)
    policy.scored = 0
    big = index.insert(_key([7] * 40), n * size // 2, True)
    assert index.begin_persist(big)
    left = index.counters.demotions if tier == "ram" else index.counters.disk_evictions
    assert left == n // 2 and policy.scored <= n


class _LeftInOrder:
    """A listener that records the entries leaving a tier, in order."""

    def __init__(self) -> None:
        self.left: dict[str, list[int]] = {"ram": [], "disk": []}

    def left_ram(self, entry, freed):
        self.left["ram"].append(entry.entry_id)

    def left_disk(self, entry, freed):
        self.left["disk"].append(entry.entry_id)


def _scan_per_victim(index, where, free, need, sizes):
    """The reference: each victim the highest scored idle entry left (the older
    on a tie), chosen anew until ``need`` bytes are free."""
    now = index._clock()
    left = [e for e in index.entries() if e.refs == 0 and where(e)]
    out = []
    while free < need and left:
        victim = max(left, key=lambda e: (index.eviction_score(e, now), -e.entry_id))
        left.remove(victim)
        out.append(victim.entry_id)
        free += sizes[victim.entry_id]
    return out


@pytest.mark.parametrize("tier", ["ram", "disk"])
@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(
        st.tuples(
            st.integers(1, 3),  # length, in blocks
            st.integers(0, 2),  # hits
            st.integers(0, 3),  # last used
            st.integers(1, 4),  # bytes
            st.booleans(),  # being read
            st.booleans(),  # saved
            st.booleans(),  # still in RAM (disk tier)
        ),
        min_size=1,
        max_size=25,
    ),
    need=st.integers(1, 60),
)
def test_victims_leave_in_the_order_a_scan_per_victim_chose(tier, specs, need):
    """Scoring once per call must not change which entries go, nor in which order
    (ties are frequent here: equal lengths, hits and ages)."""
    now = [0.0]
    order = _LeftInOrder()
    index = PrefixIndex(
        max_bytes=10**6,
        max_entries=10**6,
        block_size=4,
        disk_bytes=10**6,
        listener=order,
        clock=lambda: now[0],
    )
    sizes = {}
    for i, (blocks, hits, used, size, busy, saved, in_ram) in enumerate(specs):
        entry_id = index.insert(_key([1000 * i + t for t in range(4 * blocks)]), size, True)
        assert index.begin_persist(entry_id)
        index.end_persist(entry_id, True)
        entry = index.get(entry_id)
        entry.hits, entry.last_used, entry.refs, entry.pinned = hits, float(used), int(busy), saved
        if tier == "disk" and not in_ram:
            index._drop_ram(entry)
        sizes[entry_id] = size
    now[0] = 5.0
    order.left["ram"].clear()
    total = sum(sizes.values())
    need = min(need, total)  # larger never fits: nothing is evicted for it
    if tier == "ram":
        index.max_bytes = total
        expected = _scan_per_victim(index, lambda e: e.in_ram, 0, need, sizes)
        index.insert(_key(list(range(99000, 99004))), need, True)
    else:
        index.disk.max_bytes = total
        big = index.insert(_key(list(range(99000, 99004))), need, True)
        where = lambda e: e.on_disk and not e.pinned and e.entry_id != big  # noqa: E731
        expected = _scan_per_victim(index, where, 0, need, sizes)
        index.begin_persist(big)
    assert order.left[tier] == expected


@pytest.mark.parametrize(
    "own_entry, session, reused",
    [(True, "conv-a", 20), (True, "conv-b", 8), (True, None, 8), (False, "conv-a", 8)],
)
def test_a_reminder_only_the_entry_has_is_read_only_by_its_own_conversation(
    own_entry, session, reused
):
    """Another conversation with the same system prompt and the same words, minus
    the reminder (its plan mode, a file's secrets), hit the entry and read it. Its
    own conversation read it on an earlier turn: that one still steps over it
    (None: the request has no id of its own, see CacheHints.own_conversation). An
    entry stored under a shared prompt_cache_key or a fallback id is nobody's own:
    a client naming its conversation by that string read the other's reminder."""
    from kvcache.volatile_rules import RULES

    reminder = next(i for i, r in enumerate(RULES) if r.name == "system_reminder")
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m")
    head, tail = list(range(100, 108)), list(range(200, 212))
    entry = _key(head + [7, 7, 7, 7] + tail, [TokenSpan(8, 12, reminder)])
    index.insert(entry, 24, True, session="conv-a", own_session=own_entry)
    hit = index.lookup(_key(head + tail + [5]), session=session).hit
    assert hit is not None and hit.alignment.request_depth == reused


def test_stored_kv_carries_whether_its_session_was_its_conversations_own():
    from engine import row_kv
    from scheduler.request import CacheHints

    seen = {}

    class Cache:
        def store(self, key, caches, session, kv_bits, adapter, own_session=False):
            seen.update(session=session, own_session=own_session)
            return 1

    for own in (True, False):
        hints = CacheHints(_key([1, 2, 3]), "c-1", own_conversation=own)
        row_kv._store(Cache(), _key([1, 2, 3]), [], hints)  # noqa: SLF001
        assert seen == {"session": "c-1", "own_session": own}


def test_an_insert_compares_tokens_only_with_entries_its_chain_reaches(monkeypatch):
    """Storing a key compared its tokens with every entry sharing its first block
    (a conversation tree on disk: 95 ms per insert on the engine thread). An
    entry's last block hash, chained over all its tokens, rules out the others."""
    import kvcache.index as index_module

    compared = []
    real = index_module._strict_prefix

    def spy(short, long):
        compared.append(short)
        return real(short, long)

    monkeypatch.setattr(index_module, "_strict_prefix", spy)
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m", disk_bytes=10**6)
    base = list(range(100, 160))
    branches = [base[:n] + [900 + n] * 4 for n in range(8, 48, 4)]
    for i, tokens in enumerate(branches):  # each goes its own way after a shared stem
        index.restore(_key(tokens), EntryBytes(private=1), True, None, f"u{i}")
    prefix_ids = [
        index.restore(_key(base[:n]), EntryBytes(private=1), True, None, f"p{n}") for n in (12, 30)
    ]
    index.insert(_key(base + [5]), EntryBytes(private=1), True)
    assert sorted(len(k.model_tokens) for k in compared) == [12, 30]
    assert all(entry_id not in index for entry_id in prefix_ids)  # superseded as before
    assert len(index) == len(branches) + 1


def test_a_lookup_on_a_hybrid_model_sorts_no_bucket_of_other_conversations(monkeypatch):
    """Entries of a recurrent model hit only whole; a lookup sorted the bucket of
    every entry sharing the system prompt once per block of it (25 ms per lookup
    at 2,000 entries). Whole-only entries are found by their last block's hash."""
    import kvcache.index as index_module

    sorted_ids = []

    def spy(ids, **kwargs):
        ids = list(ids)
        sorted_ids.extend(ids)
        return sorted(ids, **kwargs)

    monkeypatch.setattr(index_module, "sorted", spy, raising=False)
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m")
    system = list(range(500, 532))
    checkpoint = index.insert(_key(system), 32, trimmable=False)
    for n in range(40):  # other conversations sharing the system prompt
        index.insert(_key(system + [1000 + 30 * n + k for k in range(20)]), 52, trimmable=False)
    mine = system + [9, 9, 9, 9]
    turn = index.insert(_key(mine), 36, trimmable=False)
    sorted_ids.clear()
    res = index.lookup(_key(mine + [7, 7, 7]), acquire=False)
    assert res.hit.entry.entry_id == turn and res.hit.reused == 36
    assert res.candidates == 2 and checkpoint in res.judged
    assert len(sorted_ids) <= 2  # the two whole entries, not 41 entries x 8 blocks
    # cut back, another conversation's entry would have served no more than these
    assert index.counters.hybrid_trim_miss == 0


@pytest.mark.parametrize("ok", [True, False])
def test_kv_is_kept_when_the_entry_covering_it_cannot_be_read_now(ok):
    """An entry demoted from RAM while its write is still queued holds no KV that
    can be had: storing the same tokens, or a prefix of them, counted as already
    cached dropped the fresh KV, lookups missed until the write landed, and a
    failed write lost it for good."""
    index = PrefixIndex(max_bytes=10**6, block_size=4, namespace="m", disk_bytes=10**6)
    system = list(range(100, 132))
    turn = system + list(range(200, 240))
    long_id = index.insert(_key(turn), held_for(_key(turn)), True, persist=True)
    assert index.insert(_key(system), held_for(_key(system)), True) is None  # served by it
    index._leave_ram(index.get(long_id))  # RAM pressure while the writer lags
    assert not index.get(long_id).loadable
    short_id = index.insert(_key(system), held_for(_key(system)), True)
    same_id = index.insert(_key(turn), held_for(_key(turn)), True, persist=True)
    assert short_id is not None and same_id is not None
    assert not index.get(same_id).persisting  # its twin's write is under way: not written twice
    assert index.lookup(_key(system + [5]), acquire=False).hit.reused == 32
    index.end_persist(long_id, ok)
    hit = index.lookup(_key(turn + [5]), acquire=False).hit
    assert hit is not None and hit.reused == len(turn)
    # stored again, a loadable equal entry is enough
    assert index.insert(_key(turn), held_for(_key(turn)), True) is None
