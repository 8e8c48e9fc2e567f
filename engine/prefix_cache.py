"""KV payloads of cached prefixes, behind the pure-Python index and session layer.

Runs on the engine thread only (it touches MLX arrays). An entry's payload is
the per-sequence cache list mlx-lm's BatchGenerator hands out
(``extract_cache`` / a finished response's ``prompt_cache``); a hit hands back a
shallow copy cut to the accepted depth, which BatchGenerator merges (copies)
into the running batch, so stored payloads are never written to.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from kvcache.index import PrefixIndex, PromptCacheConfig
from kvcache.prompt_key import PromptKey
from kvcache.sessions import SessionStore
from scheduler.request import CacheHints, CacheReport

log = logging.getLogger("kvwarm.prefix_cache")


@dataclass
class Reuse:
    """What a request starts from: KV for ``kv_key`` and the prompt tokens after it."""

    entry_id: int
    caches: list
    kv_key: PromptKey  # the prompt the reused KV stands for (old volatile values)
    kv_depth: int  # KV positions reused (== entry depth)
    request_depth: int  # the request's prompt tokens this KV stands for
    layer: str


def _cut(caches: list, keep: int, length: int) -> list:
    """Shallow copies of ``caches`` holding only the first ``keep`` positions
    (trimming a copy moves its offset; the stored arrays are left alone)."""
    out = [copy.copy(c) for c in caches]
    if keep < length:
        trim_prompt_cache(out, length - keep)
    return out


class PrefixCache:
    def __init__(self, config: PromptCacheConfig, max_bytes: int, namespace: str):
        self.config = config
        self._payloads: dict[int, list] = {}
        self.index = PrefixIndex(
            max_bytes=max_bytes,
            max_entries=config.max_entries,
            block_size=config.block_size,
            ttl_s=config.ttl_s,
            namespace=namespace,
            policy=config.policy,
            on_remove=self._drop_payload,
        )
        self.sessions = SessionStore()
        self._freed = False

    def _drop_payload(self, entry_id: int) -> None:
        self._payloads.pop(entry_id, None)
        self._freed = True

    def _return_memory(self) -> None:
        if self._freed:
            mx.clear_cache()  # give freed KV buffers back to the OS
            self._freed = False

    def lookup(
        self, request_id: str, hints: CacheHints, max_growth: int
    ) -> tuple[Reuse | None, CacheReport]:
        key = hints.key
        promised = self.sessions.promised_tokens(
            hints.session_id, hints.message_hashes, key.message_ends
        )
        result = self.index.lookup(
            key, self.sessions.candidates(hints.session_id), promised, max_growth=max_growth
        )
        self._return_memory()
        for reason in result.rejected:
            log.info("%s: prefix cache rejected %s", request_id, reason)
        rejected = tuple(str(r) for r in result.rejected)
        if result.hit is None:
            log.info(
                "%s: prefix cache miss (%d candidates, session %s)",
                request_id,
                result.candidates,
                hints.session_id,
            )
            return None, CacheReport(candidates=result.candidates, rejected=rejected)
        entry, al = result.hit.entry, result.hit.alignment
        log.info(
            "%s: prefix cache hit (%s layer): %d of %d prompt tokens from entry %d (%d tokens), "
            "%d stale volatile tokens, session %s",
            request_id,
            result.layer,
            al.request_depth,
            len(key.model_tokens),
            entry.entry_id,
            entry.length,
            al.stale_tokens,
            hints.session_id,
        )
        reuse = Reuse(
            entry.entry_id,
            _cut(self._payloads[entry.entry_id], al.entry_depth, entry.length),
            entry.key.spliced(al.entry_depth, key, al.request_depth),
            al.entry_depth,
            al.request_depth,
            result.layer,
        )
        report = CacheReport(
            result.layer,
            al.request_depth,
            entry.length,
            al.stale_tokens,
            result.candidates,
            rejected,
        )
        return reuse, report

    def release(self, entry_id: int) -> None:
        self.index.release(entry_id)

    def store(self, key: PromptKey, caches: list, session: str | None = None) -> int | None:
        """Keep ``caches`` (KV of exactly ``key.model_tokens``) for later requests."""
        nbytes = sum(c.nbytes for c in caches)
        entry_id = self.index.insert(key, nbytes, can_trim_prompt_cache(caches), session)
        if entry_id is not None:
            mx.eval([c.state for c in caches])  # materialise: drop views of batch buffers
            self._payloads[entry_id] = caches
        self._return_memory()
        return entry_id

    def record_turn(self, hints: CacheHints, entry_id: int | None) -> None:
        self.sessions.record_turn(
            hints.session_id, hints.message_hashes, hints.key.message_ends, entry_id
        )

    def stats(self) -> dict:
        c = self.index.counters
        return {
            "policy": self.config.policy.value,
            "block_size": self.config.block_size,
            "entries": len(self.index),
            "bytes": self.index.nbytes,
            "max_bytes": self.index.max_bytes,
            "sessions": len(self.sessions),
            "lookups": c.lookups,
            "tokens_queried": c.tokens_queried,
            "hits": c.hits,
            "misses": c.misses,
            "session_hits": c.session_hits,
            "tokens_reused": c.tokens_reused,
            "inserts": c.inserts,
            "evictions": c.evictions,
            "expired": c.expired,
            "superseded": c.superseded,
            "stale_volatile_reuse": c.stale_volatile_reuse,
            "exact_key_rejected_by_model_lcp": c.exact_key_rejected_by_model_lcp,
            "hybrid_trim_miss": c.hybrid_trim_miss,
        }
