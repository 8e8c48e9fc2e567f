"""Stored Responses (``store: true``) for ``previous_response_id`` and GET/DELETE.

Per process, in memory: entries expire after a TTL and the oldest-used go first
when the byte cap is reached. A restart forgets them (clients then get 404 and
resend the conversation).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    conversation: list[dict[str, Any]]  # template messages up to and including the reply
    stored_at: float
    nbytes: int


class ResponseStore:
    def __init__(
        self,
        ttl_s: float = 3600.0,
        max_bytes: int = 64 * 2**20,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response, default=str)) + len(json.dumps(conversation, default=str))
        if size > self.max_bytes:
            return
        self.delete(response["id"])
        self._items[response["id"]] = StoredResponse(response, conversation, self._clock(), size)
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is None:
            return None
        if self._clock() - item.stored_at > self.ttl_s:
            self.delete(response_id)
            return None
        self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is None:
            return False
        self.nbytes -= item.nbytes
        return True
