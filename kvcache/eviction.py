"""Which cached entry leaves a tier first. To add a policy: write a class with
``score`` below and register it in ``EVICTION_POLICIES`` (``--kv-eviction``)."""

from __future__ import annotations

import math
from typing import Protocol


class Scored(Protocol):
    """What a policy may read of an entry."""

    @property
    def length(self) -> int: ...

    last_used: float
    hits: int
    created: float


class EvictionPolicy(Protocol):
    name: str

    def score(self, entry: Scored, now: float) -> float:
        """Higher leaves first."""
        ...


class CostAware:
    """Old, short, rarely reused branches go before long, hot prefixes (a long
    prefix costs the most to recompute)."""

    name = "cost-aware"

    def score(self, entry: Scored, now: float) -> float:
        age = max(now - entry.last_used, 1e-3)
        return age / (math.sqrt(max(entry.length, 1)) * math.log(math.e + entry.hits))


class LeastRecentlyUsed:
    name = "lru"

    def score(self, entry: Scored, now: float) -> float:
        return now - entry.last_used


EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    p.name: p for p in (CostAware(), LeastRecentlyUsed())
}
