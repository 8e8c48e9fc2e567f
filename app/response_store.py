"""Stored Responses (``store: true``) for ``previous_response_id`` and GET/DELETE.

Per process, in memory (cachetools' TTL cache): entries expire after a TTL and
the least recently used go first when the byte cap is reached. A restart
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
    response: dict[str, Any]  # the response object as returned
    conversation: list[dict[str, Any]]  # template messages up to and including the reply
    nbytes: int


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
        size = len(json.dumps(response, default=str)) + len(json.dumps(conversation, default=str))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept
        self._items[response["id"]] = StoredResponse(response, conversation, size)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
