"""Stored Responses (``store: true``) for ``previous_response_id`` and GET/DELETE.

Per process, in memory (cachetools' TTL cache): entries expire after a TTL and
the least recently used go first when the byte cap is reached. Entries are kept
as JSON bytes: the cap counts what is held, and GET serves the bytes as they are. A restart
forgets them (clients then get 404 and resend the conversation). Used from the
event loop only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cachetools import TTLCache


@dataclass(frozen=True)
class StoredResponse:
    """Kept as JSON bytes, so the byte cap is what the store really holds (as
    Python objects a response with many small values weighed ~7x its JSON)."""

    response_json: bytes  # the response object as returned
    conversation_json: bytes  # template messages up to and including the reply

    @property
    def nbytes(self) -> int:
        return len(self.response_json) + len(self.conversation_json)

    def conversation(self) -> list[dict[str, Any]]:
        """Parsed anew on each call (a worker thread's job for a long one)."""
        return json.loads(self.conversation_json)


class ResponseStore:
    def __init__(
        self,
        ttl_s: float = 3600.0,
        max_bytes: int = 64 * 2**20,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_bytes = max_bytes
        self._items: TTLCache[str, StoredResponse] = TTLCache(
            maxsize=max_bytes, ttl=ttl_s, timer=clock, getsizeof=lambda item: item.nbytes
        )

    def __len__(self) -> int:
        self._items.expire()
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return int(self._items.currsize)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        item = StoredResponse(_json(response), _json(conversation))
        if item.nbytes > self.max_bytes:
            return  # larger than the whole store: not kept
        self._items[response["id"]] = item

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


def _json(value: Any) -> bytes:
    return json.dumps(value, default=str, ensure_ascii=False, separators=(",", ":")).encode()
