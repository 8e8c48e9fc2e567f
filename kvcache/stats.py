"""The KV store's figures, as one typed snapshot (/stats, /metrics, logs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TierStats:
    bytes: int = 0
    max_bytes: int = 0
    blocks: int = 0  # shared blocks held (each once)
    entries: int = 0
    shared_saved_bytes: int = 0  # what the same entries would hold more without sharing
    tokens: int = 0  # positions of KV the tier's entries stand for

    @property
    def bytes_per_token(self) -> float:
        """Bytes one cached position costs, as stored (before sharing)."""
        return (self.bytes + self.shared_saved_bytes) / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class KVCacheStats:
    policy: str = "reuse"
    block_size: int = 16
    kv_block_size: int = 64
    eviction: str = "cost-aware"
    entries: int = 0  # in RAM
    bytes: int = 0  # in RAM
    max_bytes: int = 0
    sessions: int = 0
    lookups: int = 0
    tokens_queried: int = 0
    hits: int = 0
    misses: int = 0
    session_hits: int = 0
    tokens_reused: int = 0
    inserts: int = 0
    evictions: int = 0
    expired: int = 0
    superseded: int = 0
    stale_volatile_reuse: int = 0
    exact_key_rejected_by_model_lcp: int = 0
    hybrid_trim_miss: int = 0
    vlm_retreat: int = 0  # a hit cut back to before an image's tokens (vision)
    ram: TierStats = TierStats()
    disk: TierStats = TierStats()
    disk_enabled: bool = False
    disk_dir: str = ""
    disk_degraded: str | None = None
    demotions: int = 0  # RAM -> disk
    promotions: int = 0  # disk -> RAM after a hit
    disk_hits: int = 0
    disk_tokens_reused: int = 0
    disk_evictions: int = 0
    disk_loads: int = 0
    disk_load_tokens: int = 0
    disk_load_bytes: int = 0
    disk_load_seconds: float = 0.0
    disk_files_written: int = 0
    disk_bytes_written: int = 0
    disk_write_errors: int = 0
    disk_writes_skipped: int = 0
    disk_files_discarded: int = 0
    disk_pending_bytes: int = 0
    restored_entries: int = 0  # found on disk at start

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
