"""Healing: give the model back what it really wrote.

Clients strip ``<think>`` blocks from assistant turns (and re-serialise tool-call
arguments) before sending the history back, so the echoed turn no longer matches
the tokens the server generated: the model would read a history it did not
write, and the KV of that turn could not be reused. This bounded store maps a
hash of the client-visible form of each reply to the original, and the request
builder swaps the original back in before rendering.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcache.value_digest import value_digest
from kvcache.volatile_rules import (
    RULES,
    VOLATILE_ROLES,
    Canonical,
    canonical_text,
    find_in_text,
    tag_blocks,
)

_OPEN, _CLOSE = "<think>", "</think>"
# deeper arguments stay the string they are: json.loads takes ~1,000 levels but
# dumping them again (here, or a template's tojson) overflows the stack a few
# levels deeper, a 500 after the parse had succeeded
MAX_ARGUMENT_DEPTH = 64


def decoded_arguments(text: str) -> Any:
    """A tool call's arguments string as the JSON value it holds, or the string
    itself when it is not JSON or nests deeper than ``MAX_ARGUMENT_DEPTH``."""
    try:
        # NaN, Infinity and 1e999 are no JSON: kept they broke every later dump
        # (a stored response no follow-up could find)
        value = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except (ValueError, RecursionError):
        return text
    return value if _nests_within(value, MAX_ARGUMENT_DEPTH) else text


def _not_json(word: str) -> Any:
    raise ValueError(f"{word} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text:.20} is out of range")
    return value


def _nests_within(value: Any, limit: int) -> bool:
    level = [value]
    for _ in range(limit + 1):
        level = [
            child
            for v in level
            if isinstance(v, (dict, list))
            for child in (v.values() if isinstance(v, dict) else v)
        ]
        if not level:
            return True
    return False


def visible_form(content: str) -> str:
    """What a client typically echoes: think blocks removed, outer whitespace trimmed.
    Linear in the content (no lazy regex: see ``tag_blocks``)."""
    kept: list[str] = []
    pos = 0
    for start, end in tag_blocks(content, _OPEN, _CLOSE):
        kept.append(content[pos:start])
        pos = end
    kept.append(content[pos:])
    text = "".join(kept)
    # a block whose opening tag the template supplied: the answer follows the last closing tag
    cut = text.rfind(_CLOSE)
    if cut >= 0:
        text = text[cut + len(_CLOSE) :]
    return text.strip()


def canonical_tool_calls(tool_calls: Sequence[dict[str, Any]] | None) -> str:
    """Tool calls independent of argument whitespace/key order and of call ids."""
    out = []
    for call in tool_calls or ():
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            args = decoded_arguments(args)  # or compared as the string it is
        out.append([fn.get("name"), args])
    return json.dumps(out, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class PlaceMemo:
    """What each message seen lately adds to the history chain, by its digest: the
    next turn resends every message, and canonicalising them all again (a volatile
    scan of each user turn, tool-call JSON) cost 18 ms a turn at 1,000 messages.
    Bounded; thread-safe (requests are prepared in worker threads)."""

    def __init__(self, max_entries: int = 16384):
        self.max_entries = max_entries
        self._items: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: bytes, value: bytes) -> None:
        with self._lock:
            self._items[key] = value
            if len(self._items) > self.max_entries:
                self._items.popitem(last=False)


def _place(message: dict[str, Any], strict: bool = False) -> bytes:
    """What one message adds to the history chain (see ``history_contexts``);
    ``strict``: only short values (a timestamp, a nonce, an id) may differ, the
    dropped blocks' text (reminders, envelopes) counts as sent."""
    content = message.get("content") or ""
    if not isinstance(content, str):
        content = json.dumps(content, sort_keys=True, default=str)
    if message.get("role") == "assistant":
        content = visible_form(content)
    elif message.get("role") in VOLATILE_ROLES:  # a new timestamp each turn is no new place
        spans = find_in_text(content)
        if strict:
            spans = [s for s in spans if RULES[s.rule].canonical is Canonical.SENTINEL]
        content = canonical_text(content, spans)
    h = hashlib.blake2b(digest_size=16)
    for part in (
        str(message.get("role")),
        content,
        canonical_tool_calls(message.get("tool_calls")),
        str(message.get("tool_call_id") or ""),
    ):
        h.update(part.encode())
        h.update(b"\x00")
    return h.digest()


def _remembered_place(message: dict[str, Any], memo: PlaceMemo, strict: bool) -> bytes:
    try:
        key = value_digest(message) + (b"s" if strict else b"")
    except (TypeError, ValueError, RecursionError):
        return _place(message, strict)
    place = memo.get(key)
    if place is None:
        place = _place(message, strict)
        memo.put(key, place)
    return place


def history_contexts(
    messages: Sequence[dict[str, Any]],
    scope: str = "",
    salts: Sequence[bytes] | None = None,
    memo: PlaceMemo | None = None,
) -> list[str]:
    """What each message answers: ``[i]`` is a hash chained over ``messages[:i]``
    (``[-1]``: over them all, what a reply to this request answers). Part of each
    reply's key, so a reply heals back only where it was generated: not into
    another conversation, nor into an earlier turn with the same visible text
    ("continue" -> "Done."). Assistant turns count by their visible form (the
    echo strips them), system and user turns by their cache-key form (volatile
    values such as a timestamp replaced), the rest as sent; ``salts[i]``: what the text does not
    show (the digests of message i's images); ``scope``: the client's session id;
    ``memo``: places of messages seen before. One pass: linear in the conversation.

    Without a session id only the short values may differ: blocks the cache key
    drops (a reminder, an envelope) count as sent, or two clients' conversations
    told apart by them alone (one reading a secret file, the other a README)
    were one place, and one's reasoning healed into the other's prompt."""
    strict = not scope
    h = hashlib.blake2b(scope.encode(), digest_size=16)
    contexts = [h.hexdigest()]
    for i, message in enumerate(messages):
        if memo is None:
            place = _place(message, strict)
        else:
            place = _remembered_place(message, memo, strict)
        salt = salts[i] if salts is not None and i < len(salts) else b""
        h = hashlib.blake2b(h.digest() + place + salt, digest_size=16)
        contexts.append(h.hexdigest())
    return contexts


def _reasoning_of(content: str) -> str:
    """The reasoning an original reply holds inline (before its first closing tag)."""
    end = content.find(_CLOSE)
    if end < 0:
        return ""
    start = content.find(_OPEN, 0, end)
    return content[start + len(_OPEN) if start >= 0 else 0 : end].strip()


def _key(content: str, tool_calls: Sequence[dict[str, Any]] | None, context: str) -> str:
    raw = "\x00".join((visible_form(content), canonical_tool_calls(tool_calls), context))
    # surrogatepass: a client's lone surrogate escape must not fail the request
    return hashlib.blake2b(raw.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _echoes(message: dict[str, Any], content: str, original: str) -> bool:
    """Whether the message is the original with its reasoning only stripped: the
    text it kept is the original's end (all of it, or what follows a kept part of
    the reasoning), and reasoning it sends apart is the original's, unedited."""
    if not original.rstrip().endswith(content.strip()):
        return False
    reasoning = message.get("reasoning_content")
    return (
        not isinstance(reasoning, str)
        or not reasoning.strip()
        or (reasoning.strip() == _reasoning_of(original))
    )


@dataclass(frozen=True)
class Original:
    content: str
    tool_calls: tuple[dict[str, Any], ...] | None = None


class HealingStore:
    """Thread-safe: requests are prepared in worker threads and remembered on the loop."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = 16 * 2**20):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, Original] = OrderedDict()
        # keys two different originals echo the same way at (two conversations with
        # no session id and the same history, or a regenerated reply): which one a
        # client kept cannot be told, and neither's reasoning may be read back. Apart
        # from the replies and longer-lived: kept among them the mark was the least
        # recently used entry, the first evicted, and a third reply there healed
        # into both conversations.
        self._ambiguous: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.healed = 0
        self.places = PlaceMemo()

    def contexts(
        self,
        messages: Sequence[dict[str, Any]],
        scope: str = "",
        salts: Sequence[bytes] | None = None,
    ) -> list[str]:
        """``history_contexts`` of a request's messages, those seen before not redone."""
        return history_contexts(messages, scope, salts, self.places)

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def _size(item: Original) -> int:
        return len(item.content.encode("utf-8", "surrogatepass")) + len(
            json.dumps(item.tool_calls or [])
        )

    def remember(
        self,
        content: str,
        tool_calls: Sequence[dict[str, Any]] | None = None,
        context: str = "",
        *,
        restore_calls: bool = True,
    ) -> None:
        """Record a reply exactly as generated; ``context`` is ``history_contexts``
        of the request it answered, ``[-1]``. With ``restore_calls`` false the calls
        only key the entry: the echo keeps its own (ids the tool results refer to)."""
        item = Original(content, tuple(tool_calls) if tool_calls and restore_calls else None)
        size = self._size(item)
        if size > self.max_bytes:
            return
        key = _key(content, tool_calls, context)
        with self._lock:
            if key in self._ambiguous:
                self._ambiguous.move_to_end(key)
                return
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= self._size(old)
                if old != item:
                    self._ambiguous[key] = None
                    if len(self._ambiguous) > 4 * self.max_entries:
                        self._ambiguous.popitem(last=False)
                    return
            self._items[key] = item
            self.nbytes += size
            while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self.nbytes -= self._size(dropped)

    def heal_all(
        self, messages: Sequence[dict[str, Any]], contexts: Sequence[str] | None = None
    ) -> list[dict[str, Any]]:
        """Every echoed reply in a conversation, swapped for its original
        (``contexts``: ``history_contexts`` of these messages)."""
        if contexts is None:
            contexts = self.contexts(messages)
        out = list(messages)
        if not self._items:
            return out
        # newest first: a long conversation's oldest replies are then the most
        # recently used, and a full store evicts others' (evicting them first
        # re-prefilled nearly the whole conversation, turn after turn)
        for i in reversed(range(len(out))):
            if out[i].get("role") == "assistant":
                out[i] = self.heal(out[i], contexts[i])
        return out

    def heal(self, message: dict[str, Any], context: str = "") -> dict[str, Any]:
        """The assistant message as generated, if this is an echo of a known reply."""
        if message.get("role") != "assistant":
            return message
        content = message.get("content") or ""
        if not isinstance(content, str) or "<think>" in content:
            # the client kept the reasoning (or wrote it: few-shot examples): not a
            # stripped echo, and swapping it could rewrite history the client owns
            return message
        key = _key(content, message.get("tool_calls"), context)
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return message
            self._items.move_to_end(key)
            same_calls = item.tool_calls is None or list(item.tool_calls) == message.get(
                "tool_calls"
            )
            if item.content == content and same_calls:
                return message
            if not _echoes(message, content, item.content):
                return message  # edited: the model reads the client's version
            self.healed += 1
        healed = dict(message, content=item.content)
        healed.pop("reasoning_content", None)  # the original carries its reasoning inline
        if item.tool_calls is not None:
            healed["tool_calls"] = list(item.tool_calls)
        return healed
