"""The Responses store's byte cap holds what the process really spends on it
(tracemalloc's count of the store's allocations), whatever the items' sizes."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from app.response_store import ResponseStore, StoredResponse

CAP = 2 * 2**20
Turn = tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]], set[str]]


def small_items() -> Iterator[Turn]:
    """Many short input items, each an id the server minted (an agent's history
    sent as items): per-object overheads outweigh their JSON."""
    for r in range(200):
        items = [
            {
                "id": f"msg_{r:012d}{i:012d}",
                "type": "message",
                "role": "user",
                "content": f"{r}.{i}",
            }
            for i in range(300)
        ]
        conversation = [{"role": "user", "content": f"{r}.{i}"} for i in range(300)]
        output = [{"id": f"msg_o{r}_{k}", "type": "message", "content": []} for k in range(3)]
        yield {"id": f"resp_{r}", "output": output}, conversation, items, {i["id"] for i in items}


def large_messages() -> Iterator[Turn]:
    """Few long messages: their JSON is what counts."""
    for r in range(60):
        conversation = [{"role": "user", "content": f"{r}.{i} " + "x" * 20_000} for i in range(6)]
        yield {"id": f"resp_{r}", "output": []}, conversation, [], set()


def growing_conversation() -> Iterator[Turn]:
    """One conversation, stored again each turn: what its turns share is held once."""
    conversation: list[dict[str, Any]] = [{"role": "system", "content": "s" * 2000}]
    for turn in range(400):
        conversation = [
            *conversation,
            {"role": "user", "content": f"question {turn}"},
            {"role": "assistant", "content": f"answer {turn} " + "a" * 100},
        ]
        yield {"id": f"resp_{turn}", "output": []}, conversation, [], set()


@pytest.mark.parametrize("workload", [small_items, large_messages, growing_conversation])
def test_the_cap_bounds_the_memory_the_store_holds(workload: Callable[[], Iterator[Turn]]):
    """Counting JSON lengths and 64 B per reference left out each message's bytes
    header, its digest, the shared table's slots, the item index's Slot tuples and
    the owners' entries: 400 responses of 500 small items held 24 MB under 8 MiB."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = ResponseStore(max_bytes=CAP)
        for response, conversation, items, minted in workload():
            store.add(response["id"], StoredResponse.of(response, conversation, items, minted))
            del response, conversation, items, minted
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.nbytes > 0.8 * CAP  # full: the cap, not the workload, bounds it
    assert held <= 1.5 * CAP, (held, store.nbytes)
    # and no charge far above the real cost: the cap would hold less than it says
    assert held >= 0.67 * store.nbytes, (held, store.nbytes)
    for response_id in list(store._items):  # noqa: SLF001
        assert store.delete(response_id)
    assert store.nbytes == 0
