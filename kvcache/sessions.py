"""Session layer: what each conversation looked like last turn.

The global index works on tokens; this layer works on message structure. Per
session it keeps the canonical message list of the last turn it saw grow by
strict appends, the cache entry that turn produced, and lineage anchors (an
entry every ``ANCHOR_TOKENS`` of growth). When the global lookup reuses less
than the unchanged leading messages promise (an edited tool result in the
middle, an entry that fell out of the chain), the session's entries are tried
directly, so everything before the change point is still reused.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

ANCHOR_TOKENS = 2048
MAX_ANCHORS = 8
# ~120 bytes each (a digest string, its end offset): about 30 MiB, all sessions
# together. A count of sessions alone let 256 clients of 8,192 messages hold 242 MiB.
MAX_MESSAGES = 262_144
FALLBACK_PREFIX_TOKENS = 128


def fallback_session_id(canonical_tokens: Sequence[int]) -> str:
    """Requests without an explicit session id group by their first 128 cache-key
    tokens (canonical: a per-request nonce in line one must not split sessions)."""
    head = canonical_tokens[:FALLBACK_PREFIX_TOKENS]
    digest = hashlib.blake2b(struct.pack(f"<{len(head)}q", *head), digest_size=8).hexdigest()
    return f"auto-{digest}"


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
    """Least recently written records go first, past ``max_sessions`` records or
    ``max_messages`` messages held; the record just written always stays."""

    def __init__(self, max_sessions: int = 256, max_messages: int = MAX_MESSAGES):
        self.max_sessions = max_sessions
        self.max_messages = max_messages
        self._records: OrderedDict[str, TurnRecord] = OrderedDict()
        self._messages_held = 0
        self.rejected_writes = 0  # branches / edits that did not clobber a record

    def __len__(self) -> int:
        return len(self._records)

    @property
    def messages_held(self) -> int:
        return self._messages_held

    def forget(self, session: str) -> None:
        record = self._records.pop(session, None)
        if record is not None:
            self._messages_held -= len(record.messages)

    def get(self, session: str) -> TurnRecord | None:
        return self._records.get(session)

    def promised_tokens(self, session: str, messages: Sequence[str], ends: Sequence[int]) -> int:
        """Tokens covered by the messages this request shares with the session's
        record: the prefix the cache ought to reuse."""
        record = self._records.get(session)
        if record is None:
            return 0
        shared = change_point(record.messages, messages)
        if shared == 0 or shared > len(ends):
            return 0
        return ends[shared - 1]

    def candidates(self, session: str) -> list[int]:
        record = self._records.get(session)
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
        """Write the turn if it strictly extends the record (or starts one): a
        sub-agent branch or a mid-history edit must not clobber its parent."""
        messages = tuple(messages)
        record = self._records.get(session)
        if record is not None:
            appends = (
                len(messages) >= len(record.messages)
                and messages[: len(record.messages)] == record.messages
            )
            if not appends:
                self.rejected_writes += 1
                return False
        anchors = list(record.anchors) if record is not None else []
        if record is not None and record.entry_id is not None:
            last = anchors[-1][0] if anchors else 0
            prev_tokens = record.message_ends[-1] if record.message_ends else 0
            if prev_tokens - last >= ANCHOR_TOKENS:
                anchors.append((prev_tokens, record.entry_id))
                del anchors[:-MAX_ANCHORS]
        self.forget(session)
        self._records[session] = TurnRecord(messages, tuple(ends), entry_id, anchors)
        self._messages_held += len(messages)
        while len(self._records) > 1 and (
            len(self._records) > self.max_sessions or self._messages_held > self.max_messages
        ):
            _, oldest = self._records.popitem(last=False)
            self._messages_held -= len(oldest.messages)
        return True
