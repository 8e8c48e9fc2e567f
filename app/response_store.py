"""Stored Responses (``store: true``) for ``previous_response_id`` and GET/DELETE.

Per process, in memory: entries expire after a TTL and the least recently used
go first when the byte cap is reached. Entries are kept as JSON bytes, a
conversation as one JSON text per message: each turn of a conversation stores
all of it again, and messages the turns share (their images too) are held once,
so a conversation costs what it holds, not the sum of every turn's copy (13
turns beside a 5 MiB image held 60 MiB and evicted every other client's
responses). A response's input items are kept too (listed by input_items,
named by an ``item_reference``), held once in the same way. A restart forgets
them (clients then get 404 and resend the conversation). The store itself is used from the event loop only;
``StoredResponse.of`` (the JSON encoding, as long as the conversation) belongs
in a worker thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple

from app.body import json_values
from app.images import ImageSource

log = logging.getLogger("kvwarm.http")

# What CPython spends besides the JSON (3.11, 64-bit; measured with tracemalloc,
# tests/unit/test_response_store_memory.py holds the cap to it). JSON lengths
# alone undercounted 500 small items' responses ~3x. Each object's own size is
# sys.getsizeof's (its GC header apart); these are the objects around it:
# a response: its StoredResponse and _Held with their __dicts__, its LRU entry,
# its deadline (a tuple and a float), GC headers of its tuples and index
ENTRY_BYTES = 600
# an entry's reference to a message: its two tuple slots (counted by getsizeof)
# and its own digest object
DIGEST_BYTES = sys.getsizeof(bytes(16))
# a message held once: the shared table's slot and its [message, count] list
SHARED_BYTES = 136
# an id an item_reference may name: its Slot (a 3-tuple, an int past the small
# ones), its slots in the index and in the store's owners table
INDEXED_ID_BYTES = 180


class Slot(NamedTuple):
    """Where an item an ``item_reference`` may name is, and what it weighs: a
    reference is held to a body's limits by what it names, read without parsing."""

    at: int  # in ``items_json``, or past its end in the response's output
    nbytes: int  # its JSON's length
    values: int  # the JSON values it holds (as a body's are counted)


@dataclass(frozen=True)
class StoredResponse:
    """Kept as JSON bytes, so the byte cap is what the store really holds (as
    Python objects a response with many small values weighed ~7x its JSON)."""

    response_json: bytes  # the response object as returned
    # template messages up to and including the reply, then the request's input
    # items (as listed, less their ids), as JSON: both held once when the same
    # (turns repeat them; an item with its new id each time was never the same)
    messages: tuple[bytes, ...]
    digests: tuple[bytes, ...]  # of each message: the same message is held once
    turns: int = -1  # how many of ``messages`` are the conversation (-1: all)
    item_ids: tuple[str, ...] = ()  # of the input items, in order
    output_ids: tuple[str, ...] = ()  # of the response's output items, in order
    # id -> its slot, built once in a worker thread (a lookup scanning the ids
    # made 20k references to one response's items quadratic); only ids the
    # server made: one a client chose (msg_1) may be any other client's too
    index: dict[str, Slot] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(
        cls,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        items: Sequence[dict[str, Any]] = (),
        minted: Collection[str] = (),
    ) -> StoredResponse | None:
        """Encoded for the store (a worker thread's job); None if a value JSON
        cannot hold (not kept: the reply stands). Of the input items, those whose
        ids are ``minted`` (the server's) may be named by an ``item_reference``."""
        # an item without its id (kept in item_ids): a client sending its history
        # again, as each turn does, shares what it sent before
        bare = [{k: v for k, v in i.items() if k != "id"} for i in items]
        try:
            messages = tuple(_json(m) for m in [*conversation, *bare])
            response_json = _json(response)
        except (TypeError, ValueError):
            log.exception("response %s not stored", response.get("id"))
            return None
        digests = tuple(hashlib.blake2b(m, digest_size=16).digest() for m in messages)
        item_ids = tuple(i["id"] for i in items)
        index = {
            item_id: Slot(at, len(m), json_values(m))
            for at, (item_id, m) in enumerate(zip(item_ids, messages[len(conversation) :]))
            if item_id in minted
        }
        output = response.get("output") or ()
        for at, item in enumerate(output, len(item_ids)):  # the server's ids, all
            encoded = _json(item)  # weighed once here, never parsed to be weighed
            index[item["id"]] = Slot(at, len(encoded), json_values(encoded))
        return cls(
            response_json,
            messages,
            digests,
            len(conversation),
            item_ids,
            tuple(i["id"] for i in output),
            index,
        )

    @property
    def ids(self) -> tuple[str, ...]:
        """The ids an ``item_reference`` may name."""
        return tuple(self.index)

    @property
    def own_bytes(self) -> int:
        """What it holds besides the messages it may share, Python's overheads included
        (the same before and after the store swaps in the shared messages)."""
        size = sys.getsizeof
        containers = (self.messages, self.digests, self.item_ids, self.output_ids, self.index)
        ids = sum(size(i) for i in self.item_ids) + sum(size(i) for i in self.output_ids)
        return (
            ENTRY_BYTES
            + size(self.response_json)
            + sum(size(c) for c in containers)
            + DIGEST_BYTES * len(self.digests)
            + ids
            + INDEXED_ID_BYTES * len(self.index)
        )

    @property
    def nbytes(self) -> int:
        """What it holds on its own (shared messages included)."""
        return self.own_bytes + sum(shared_bytes(m) for m in self.messages)

    @property
    def _conversation(self) -> tuple[bytes, ...]:
        return self.messages if self.turns < 0 else self.messages[: self.turns]

    @property
    def items_json(self) -> tuple[bytes, ...]:
        """The input items as listed, each as JSON without its id."""
        return () if self.turns < 0 else self.messages[self.turns :]

    def item_json(self, at: int) -> bytes:
        """The input item at ``at`` as listed, its id put back (nothing parsed)."""
        raw = self.items_json[at]
        rest = b"}" if raw == b"{}" else b"," + raw[1:]
        return b'{"id":' + json.dumps(self.item_ids[at]).encode() + rest

    @property
    def conversation_json(self) -> bytes:
        """The conversation as one JSON array (as long as it: a worker thread's job)."""
        return b"[" + b",".join(self._conversation) + b"]"

    def item(
        self, item_id: str, outputs: dict[int, list[Any]] | None = None
    ) -> dict[str, Any] | None:
        """An input or output item by its id, parsed (a worker thread's job).
        ``outputs`` keeps each response's parsed output for the next reference to
        it: parsing the whole response per reference was 1.1 s for 1,000 of them."""
        slot = self.index.get(item_id)
        if slot is None:
            return None
        if slot.at < len(self.item_ids):
            return {"id": item_id, **json.loads(self.items_json[slot.at])}
        outputs = {} if outputs is None else outputs
        if id(self) not in outputs:
            outputs[id(self)] = json.loads(self.response_json)["output"]
        return outputs[id(self)][slot.at - len(self.item_ids)]  # type: ignore[no-any-return]

    def conversation(self) -> list[dict[str, Any]]:
        """Parsed anew on each call (a worker thread's job for a long one), its
        image parts' sources rebuilt. Only where an image part keeps its source:
        a client's own JSON elsewhere (a tool call's arguments) is never read as one."""
        messages = [json.loads(m) for m in self._conversation]
        for message in messages:
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    part["source"] = ImageSource(**part["source"])
        return messages


@dataclass(frozen=True)
class _Held:
    item: StoredResponse
    expires: float


class ResponseStore:
    def __init__(
        self,
        ttl_s: float = 3600.0,
        max_bytes: int = 64 * 2**20,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, _Held] = OrderedDict()  # least recently used first
        self._deadlines: deque[tuple[float, str]] = deque()  # in order: one TTL for all
        self._shared: dict[bytes, list[Any]] = {}  # digest -> [message JSON, references]
        # item id -> the response holding it. Only ids the server made are indexed
        # (random, 96 bits): each is held by the one response that made it, so
        # one holder per id is all there is (a client's ids, which two clients
        # may share, are listed but never indexed)
        self._owners: dict[str, str] = {}
        self._bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(
        self,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        items: Sequence[dict[str, Any]] = (),
        minted: Collection[str] = (),
    ) -> None:
        """Encode and keep (a short conversation; a long one: ``of`` then ``add``)."""
        self.add(response["id"], StoredResponse.of(response, conversation, items, minted))

    def add(self, response_id: str, item: StoredResponse | None) -> None:
        if item is None or item.nbytes > self.max_bytes:
            return  # not encodable, or larger than the whole store: not kept
        self._expire()
        self.delete(response_id)
        messages = tuple(self._share(d, m) for d, m in zip(item.digests, item.messages))
        held = replace(item, messages=messages)
        self._bytes += held.own_bytes
        self._owners.update(dict.fromkeys(held.ids, response_id))
        expires = self._clock() + self.ttl_s
        self._items[response_id] = _Held(held, expires)
        self._deadlines.append((expires, response_id))
        while self._bytes > self.max_bytes:
            oldest_id, oldest = self._items.popitem(last=False)
            self._release(oldest_id, oldest.item)
        if len(self._deadlines) > 2 * len(self._items) + 64:
            # entries of items evicted or deleted since (only expiry removed them): a
            # small store under steady traffic held one per response for the whole TTL
            self._deadlines = deque(
                d for d in self._deadlines if (h := self._items.get(d[1])) and h.expires == d[0]
            )

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        held = self._items.get(response_id)
        if held is None:
            return None
        self._items.move_to_end(response_id)
        return held.item

    def holding(self, item_id: str) -> StoredResponse | None:
        """The stored response an input or output item of that id belongs to."""
        owner = self._owners.get(item_id)
        return self.get(owner) if owner is not None else None

    def delete(self, response_id: str) -> bool:
        self._expire()  # one past its TTL is gone: a 404, not "deleted"
        held = self._items.pop(response_id, None)
        if held is None:
            return False
        self._release(response_id, held.item)
        return True

    def _share(self, digest: bytes, message: bytes) -> bytes:
        shared = self._shared.get(digest)
        if shared is None:
            self._shared[digest] = [message, 1]
            self._bytes += shared_bytes(message)
            return message
        shared[1] += 1
        return shared[0]  # type: ignore[no-any-return]

    def _release(self, response_id: str, item: StoredResponse) -> None:
        self._bytes -= item.own_bytes
        for item_id in item.ids:
            if self._owners.get(item_id) == response_id:
                del self._owners[item_id]
        for digest in item.digests:
            shared = self._shared[digest]
            shared[1] -= 1
            if shared[1] == 0:
                del self._shared[digest]
                self._bytes -= shared_bytes(shared[0])

    def _expire(self) -> None:
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            expires, response_id = self._deadlines.popleft()  # (an id deleted since: skipped)
            held = self._items.get(response_id)
            if held is not None and held.expires == expires:
                del self._items[response_id]
                self._release(response_id, held.item)


def shared_bytes(message: bytes) -> int:
    """What a message held once costs: its bytes object and the shared table's share."""
    return sys.getsizeof(message) + SHARED_BYTES


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
