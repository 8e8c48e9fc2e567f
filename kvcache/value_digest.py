"""A digest of a JSON-like value, equal for equal values: how a request's messages
are recognised again on the next turn (engine.chat_render, kvcache.healing)."""

from __future__ import annotations

import hashlib
import json
import marshal
from typing import Any

# messages come from JSON: no cycles to check for (a third of the encoding's time)
_ENCODER = json.JSONEncoder(sort_keys=True, default=repr, check_circular=False)


def value_digest(value: Any) -> bytes:
    """A digest equal for equal values. marshal (format 0: no back-references or
    interning flags, which would depend on object identity) encodes a message in a
    fifth of JSON's time, and a new turn digests every message of the history.
    Dicts encode in their key order: the same message with its keys reordered
    digests differently, which costs a reuse, never a wrong one."""
    try:
        encoded = marshal.dumps(value, 0)
    except ValueError:  # a value marshal has no form for
        encoded = b"json:" + _ENCODER.encode(value).encode()
    return hashlib.blake2b(encoded, digest_size=16).digest()
