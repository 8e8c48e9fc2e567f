"""Stored Responses (``store: true``) for ``previous_response_id`` and GET/DELETE.

Per process, in memory (cachetools' TTL cache): entries expire after a TTL and
the least recently used go first when the byte cap is reached. Entries are kept
as JSON bytes: the cap counts what is held, and GET serves the bytes as they are. A restart
forgets them (clients then get 404 and resend the conversation). The store itself
is used from the event loop only; ``StoredResponse.of`` (the JSON encoding, as
long as the conversation) belongs in a worker thread.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from cachetools import TTLCache

from app.images import ImageSource

log = logging.getLogger("kvwarm.http")


@dataclass(frozen=True)
class StoredResponse:
    """Kept as JSON bytes, so the byte cap is what the store really holds (as
    Python objects a response with many small values weighed ~7x its JSON)."""

    response_json: bytes  # the response object as returned
    conversation_json: bytes  # template messages up to and including the reply

    @classmethod
    def of(
        cls, response: dict[str, Any], conversation: list[dict[str, Any]]
    ) -> StoredResponse | None:
        """Encoded for the store (a worker thread's job); None if a value JSON
        cannot hold (not kept: the reply stands)."""
        try:
            return cls(_json(response), _json(conversation))
        except (TypeError, ValueError):
            log.exception("response %s not stored", response.get("id"))
            return None

    @property
    def nbytes(self) -> int:
        return len(self.response_json) + len(self.conversation_json)

    def conversation(self) -> list[dict[str, Any]]:
        """Parsed anew on each call (a worker thread's job for a long one), its
        image parts' sources rebuilt. Only where an image part keeps its source:
        a client's own JSON elsewhere (a tool call's arguments) is never read as one."""
        messages = json.loads(self.conversation_json)
        for message in messages:
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    part["source"] = ImageSource(**part["source"])
        return messages


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
        """Encode and keep (a short conversation; a long one: ``of`` then ``add``)."""
        self.add(response["id"], StoredResponse.of(response, conversation))

    def add(self, response_id: str, item: StoredResponse | None) -> None:
        if item is None or item.nbytes > self.max_bytes:
            return  # not encodable, or larger than the whole store: not kept
        self._items[response_id] = item

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


def _json(value: Any) -> bytes:
    return json.dumps(
        value, default=_encode, ensure_ascii=False, allow_nan=False, separators=(",", ":")
    ).encode()


def _encode(value: Any) -> Any:
    """An image part's source (the conversation keeps where each image is); any
    other type is an error, never silently stored as its repr."""
    if isinstance(value, ImageSource):
        return asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")
