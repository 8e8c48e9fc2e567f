"""A row's prefix-cache traffic: the KV it starts from, the checkpoints where
its prompt's KV is stored on the way, and the prompt + reply KV kept when it
ends. Engine-thread code (the caches are MLX arrays); engine.batch_runner calls
it at those three moments."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.batch_rows import Row, kv_only
from kvcache.disk_reads import PendingHit
from kvcache.manager import Reuse, TieredKVManager
from kvcache.prompt_key import PromptKey
from scheduler.admission import round_up
from scheduler.request import CacheHints

ModelIds = Callable[[Sequence[int]], list[int]]  # a key's tokens as the model's ids


def start_from_cache(
    cache: TieredKVManager, row: Row, defer_disk: bool = False
) -> tuple[list | None, Sequence[int] | None]:
    """Look the row's prompt up; on a hit the row holds the entry (``row.entry_id``,
    released once prefilled) and starts from its caches, which hold the returned
    cache-key tokens. ``defer_disk``: a disk-tier hit is read on the KV reader
    thread; the row holds it as ``row.disk_read`` (a miss until ``finish_from_cache``)."""
    request, hints = row.request, row.request.cache
    assert hints is not None
    # KV positions the admission reservation (rounded up) has to spare
    slack = round_up(request.reserved_tokens) - request.reserved_tokens
    reuse, row.report = cache.lookup(
        request.request_id, hints, max_growth=slack, defer_disk=defer_disk
    )
    row.kv_key = hints.key
    if isinstance(reuse, PendingHit):
        row.disk_read = reuse
        return None, None
    return _reused(row, reuse)


def finish_from_cache(cache: TieredKVManager, row: Row) -> tuple[list | None, Sequence[int] | None]:
    """The row's disk read is done: its hit as ``start_from_cache`` gives one, or
    a miss (a cold prefill from token 0, its report claiming nothing) if it failed."""
    pending, row.disk_read = row.disk_read, None
    assert pending is not None
    reuse, row.report = cache.finish_read(pending)
    return _reused(row, reuse)


def _reused(row: Row, reuse: Reuse | None) -> tuple[list | None, Sequence[int] | None]:
    if reuse is None:
        return None, None
    row.cached, row.kv_offset = reuse.request_depth, reuse.kv_depth
    row.kv_key, row.entry_id = reuse.kv_key, reuse.entry_id
    return reuse.caches, reuse.kv_key.model_tokens[: reuse.kv_depth]


def checkpoints(
    cache: TieredKVManager, hints: CacheHints, trimmable: bool, cached: int, remaining: int
) -> list[int]:
    """Where prefill pauses to store KV (as progress after ``cached``).

    Always the end of the system prompt + tools: an agent arriving while
    this one still generates (a sub-agent) reuses it at once. For caches
    that cannot be cut back (recurrent layers) also the end of the last
    message, which the next turn shares even if the reply re-tokenises
    differently, since such an entry only ever hits whole."""
    points = {hints.key.stable_prefix_end}
    if not trimmable and hints.key.message_ends:
        points.add(hints.key.message_ends[-1])
    min_gain = cache.config.block_size
    return sorted(p - cached for p in points if min_gain <= p - cached < remaining)


def store_checkpoint(cache: TieredKVManager, row: Row, caches: list) -> None:
    """Store the KV of the prompt so far: prefill has reached the row's next checkpoint."""
    assert row.kv_key is not None and row.request.cache is not None
    key = row.kv_key.truncated(row.kv_offset + row.checkpoints.pop(0))
    hints = row.request.cache
    _store(cache, key, caches, hints)


def store_final(
    cache: TieredKVManager, row: Row, caches: list, all_tokens, model_ids: ModelIds
) -> None:
    """Keep prompt + reply KV: the next turn of this conversation starts with it."""
    if row.kv_key is None or not caches:
        return
    base = row.kv_key.model_tokens
    if list(all_tokens[: len(base)]) != model_ids(base):
        return  # should not happen; never store KV under the wrong tokens
    key = row.kv_key.extended(all_tokens[len(base) :])
    hints = row.request.cache
    assert hints is not None
    entry_id = _store(cache, key, caches, hints)
    cache.record_turn(hints, entry_id)


def _store(cache: TieredKVManager, key: PromptKey, caches: list, hints: CacheHints) -> int | None:
    return cache.store(
        key,
        kv_only(caches),
        hints.session_id,
        hints.kv_bits,
        hints.adapter,
        own_session=hints.own_conversation,
    )
