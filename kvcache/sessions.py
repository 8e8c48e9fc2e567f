"""Session layer: what each conversation looked like last turn.

The global index works on tokens; this layer works on message structure. Per
session and branch (its main conversation, sub-agents, side requests) it keeps
the canonical message list of the branch's last turn, the cache entry that turn
produced, and lineage anchors (an entry every ``ANCHOR_TOKENS`` of growth). When
the global lookup reuses less than the unchanged leading messages of the closest
branch promise (an edited tool result in the middle, an entry that fell out of
the chain), that branch's entries are tried directly, so everything before the
change point is still reused.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

ANCHOR_TOKENS = 2048
MAX_ANCHORS = 8
# branches kept per session: a main conversation, a few sub-agents, side requests
MAX_BRANCHES = 4
# ~120 bytes each (a digest string, its end offset): about 30 MiB, all sessions
# together. A count of sessions alone let 256 clients of 8,192 messages hold 242 MiB.
MAX_MESSAGES = 262_144
FALLBACK_PREFIX_TOKENS = 128


DERIVED_PREFIX = "auto-"
_DERIVED_DIGEST = 8  # bytes: the id is the prefix and 16 hex digits
_DERIVED = re.compile(rf"{DERIVED_PREFIX}[0-9a-f]{{{2 * _DERIVED_DIGEST}}}")


def fallback_session_id(canonical_tokens: Sequence[int]) -> str:
    """Requests without an explicit session id group by their first 128 cache-key
    tokens (canonical: a per-request nonce in line one must not split sessions)."""
    head = canonical_tokens[:FALLBACK_PREFIX_TOKENS]
    packed = struct.pack(f"<{len(head)}q", *head)
    digest = hashlib.blake2b(packed, digest_size=_DERIVED_DIGEST).hexdigest()
    return f"{DERIVED_PREFIX}{digest}"


def is_derived_id(session_id: str) -> bool:
    """Whether ``session_id`` has the shape of ``fallback_session_id``'s ids (a
    client's "auto-summarizer" does not)."""
    return _DERIVED.fullmatch(session_id) is not None


@dataclass
class TurnRecord:
    messages: tuple[str, ...]  # canonical per-message hashes
    message_ends: tuple[int, ...]  # token index at the end of each message
    entry_id: int | None = None
    anchors: list[tuple[int, int]] = field(default_factory=list)  # (tokens, entry id)


def change_point(old: Sequence[str], new: Sequence[str]) -> int:
    """Number of leading messages two canonical message lists share."""
    n = 0
    for a, b in zip(old, new):
        if a != b:
            break
        n += 1
    return n


class SessionStore:
    """Per session, the last turn of each of its few branches (a main conversation,
    its sub-agents, a client's title request), most recently written first. A turn
    that strictly extends a branch replaces it; any other starts a branch, the
    least recently written one going past ``max_branches``. With one record per
    session the first request (often a side request) kept it for good: no later
    turn of the main conversation appended to it, so none was ever recorded.
    Sessions go least recently written first, past ``max_sessions`` sessions or
    ``max_messages`` messages held; the record just written always stays."""

    def __init__(
        self,
        max_sessions: int = 256,
        max_messages: int = MAX_MESSAGES,
        max_branches: int = MAX_BRANCHES,
    ):
        self.max_sessions = max_sessions
        self.max_messages = max_messages
        self.max_branches = max_branches
        self._records: OrderedDict[str, list[TurnRecord]] = OrderedDict()
        self._messages_held = 0
        self.branches_started = 0  # writes that extended no branch of their session

    def __len__(self) -> int:
        return len(self._records)

    @property
    def messages_held(self) -> int:
        return self._messages_held

    def forget(self, session: str) -> None:
        for record in self._records.pop(session, ()):
            self._messages_held -= len(record.messages)

    def get(self, session: str) -> TurnRecord | None:
        """The session's most recently written record."""
        branches = self._records.get(session)
        return branches[0] if branches else None

    def branches(self, session: str) -> list[TurnRecord]:
        return list(self._records.get(session, ()))

    def _closest(self, session: str, messages: Sequence[str]) -> tuple[TurnRecord | None, int]:
        """The branch sharing most leading messages with ``messages`` (the most
        recently written among equals), and how many it shares."""
        best, shared = None, 0
        for record in self._records.get(session, ()):
            n = change_point(record.messages, messages)
            if n > shared:
                best, shared = record, n
        return best, shared

    def promised_tokens(self, session: str, messages: Sequence[str], ends: Sequence[int]) -> int:
        """Tokens covered by the messages this request shares with the session's
        closest branch: the prefix the cache ought to reuse."""
        _, shared = self._closest(session, messages)
        if shared == 0 or shared > len(ends):
            return 0
        return ends[shared - 1]

    def candidates(self, session: str, messages: Sequence[str] | None = None) -> list[int]:
        """The entries of the branch closest to ``messages`` (the latest branch
        when not given), its last turn's first, then its lineage anchors."""
        if messages is None:
            record = self.get(session)
        else:
            record, _ = self._closest(session, messages)
        if record is None:
            return []
        ids = [record.entry_id] if record.entry_id is not None else []
        ids.extend(entry_id for _, entry_id in reversed(record.anchors))
        return ids

    def record_turn(
        self,
        session: str,
        messages: Sequence[str],
        ends: Sequence[int],
        entry_id: int | None,
    ) -> bool:
        """Write the turn over the branch it strictly extends (True), or as a new
        branch (False): a sub-agent or an edited history does not clobber its parent."""
        messages = tuple(messages)
        branches = self._records.pop(session, [])
        extended = next(
            (
                r
                for r in sorted(branches, key=lambda r: -len(r.messages))
                if len(messages) >= len(r.messages) and messages[: len(r.messages)] == r.messages
            ),
            None,
        )
        anchors: list[tuple[int, int]] = []
        if extended is not None:
            branches.remove(extended)
            self._messages_held -= len(extended.messages)
            anchors = list(extended.anchors)
            if extended.entry_id is not None:
                last = anchors[-1][0] if anchors else 0
                prev_tokens = extended.message_ends[-1] if extended.message_ends else 0
                if prev_tokens - last >= ANCHOR_TOKENS:
                    anchors.append((prev_tokens, extended.entry_id))
                    del anchors[:-MAX_ANCHORS]
        elif branches:
            self.branches_started += 1
        branches.insert(0, TurnRecord(messages, tuple(ends), entry_id, anchors))
        self._messages_held += len(messages)
        for dropped in branches[self.max_branches :]:
            self._messages_held -= len(dropped.messages)
        del branches[self.max_branches :]
        self._records[session] = branches
        self._evict(session)
        return extended is not None or len(branches) == 1

    def _evict(self, written: str) -> None:
        """Oldest sessions first; then, if the one just written still holds too
        many messages, its older branches (its newest record always stays)."""
        while len(self._records) > 1 and (
            len(self._records) > self.max_sessions or self._messages_held > self.max_messages
        ):
            _, oldest = self._records.popitem(last=False)
            self._messages_held -= sum(len(r.messages) for r in oldest)
        branches = self._records[written]
        while len(branches) > 1 and self._messages_held > self.max_messages:
            self._messages_held -= len(branches.pop().messages)
