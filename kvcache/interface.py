"""The KV store as the rest of kvwarm sees it: one manager, typed in and out.

The engine's runner calls ``lookup`` / ``release`` / ``store`` / ``record_turn``
on the engine thread; HTTP routes reach the conversation operations through
``EngineHandle.kv`` (which runs them on the engine thread too); /stats and
/metrics read ``stats``. ``kvcache.manager.TieredKVManager`` implements it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvcache.prompt_key import PromptKey
from kvcache.stats import KVCacheStats
from scheduler.request import CacheHints, CacheReport


class ConversationNotFound(LookupError):
    """No cached KV is known for this conversation id (HTTP 404)."""


class KVCacheDisabled(Exception):
    """The prefix cache is off (--prompt-cache-bytes 0): there is no KV to save or load."""

    def __init__(
        self, message: str = "the prefix cache is off (--prompt-cache-bytes 0): no KV is kept"
    ) -> None:
        super().__init__(message)


class StorageFull(Exception):
    """The SSD tier cannot take this (HTTP 507): off, or its byte limit reached."""


@dataclass(frozen=True)
class SavedConversation:
    conversation_id: str
    title: str | None
    tokens: int
    bytes: int
    tier: str  # ram+disk, disk, ram, writing (queued), loading (read into RAM); none: gone
    saved_at: float | None  # wall clock; None: cached but not saved


class ReusedKV(Protocol):
    """What a hit hands the runner (engine-thread objects in ``caches``)."""

    entry_id: int
    caches: list[Any]
    kv_key: PromptKey
    kv_depth: int
    request_depth: int


class KVCacheManager(Protocol):
    @property
    def trimmable(self) -> bool:
        """Every layer can be cut back to any depth (else entries hit only whole)."""
        ...

    @property
    def block_size(self) -> int:
        """Cache-key tokens per lookup block: the smallest gain worth a checkpoint."""
        ...

    def lookup(
        self, request_id: str, hints: CacheHints, max_growth: int
    ) -> tuple[ReusedKV | None, CacheReport]: ...

    def release(self, entry_id: int) -> None: ...

    def store(
        self,
        key: PromptKey,
        caches: list[Any],
        session: str | None = None,
        kv_bits: int | None = None,
        adapter: str = "",
        own_session: bool = False,
    ) -> int | None: ...

    def record_turn(self, hints: CacheHints, entry_id: int | None) -> None: ...

    def stats(self) -> KVCacheStats: ...

    def poll(self) -> None:
        """Apply background work that finished (disk writes); cheap, call it often."""
        ...

    def save_conversation(self, conversation_id: str, title: str | None) -> SavedConversation: ...

    def load_conversation(self, conversation_id: str) -> SavedConversation: ...

    def saved_conversations(self) -> list[SavedConversation]: ...

    def delete_conversation(self, conversation_id: str) -> SavedConversation: ...

    def close(self) -> None: ...
