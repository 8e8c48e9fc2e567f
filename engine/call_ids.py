"""Tool-call ids for chat templates that accept only 9 alphanumerics.

Mistral's v0.3 and Nemo templates raise "Tool call IDs should be alphanumeric
strings with length 9!" on any other id, in the assistant's tool_calls and the
tool results alike, while clients send ids minted elsewhere (OpenAI's
``call_...``, Claude Code's ``toolu_...``). For such a template every other id is
mapped to a 9-character one derived from it, so the same history always renders
the same tokens (its cached prefix stays valid); ids already of that shape pass
through unchanged, and the ids kvwarm mints for such a model have it already.
"""

from __future__ import annotations

import hashlib
import secrets
import string
from collections.abc import Sequence
from itertools import count
from typing import Any

SHORT_ID_LENGTH = 9
_ALPHABET = string.ascii_letters + string.digits


def is_short_id(value: str) -> bool:
    return len(value) == SHORT_ID_LENGTH and value.isascii() and value.isalnum()


def fresh_short_id() -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(SHORT_ID_LENGTH))


def _derived(original: str, attempt: int) -> str:
    data = f"{attempt}\x00{original}".encode("utf-8", "surrogatepass")
    n = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
    out = []
    for _ in range(SHORT_ID_LENGTH):  # 62**9 < 2**64: every character from the digest
        n, digit = divmod(n, len(_ALPHABET))
        out.append(_ALPHABET[digit])
    return "".join(out)


class _Mapping:
    """Client id -> the id the template reads, assigned in order of first sight:
    an id's mapping depends only on the ids before it, so a later turn never
    changes what an earlier one rendered."""

    def __init__(self) -> None:
        self.chosen: dict[str, str] = {}
        self.taken: set[str] = set()

    def __call__(self, original: Any) -> Any:
        if not isinstance(original, str):
            return original  # a missing id: the template says what it says of that
        if (found := self.chosen.get(original)) is not None:
            return found
        if is_short_id(original) and original not in self.taken:
            new = original
        else:  # a collision, within one conversation, takes the next derivation
            new = next(d for k in count() if (d := _derived(original, k)) not in self.taken)
        self.chosen[original] = new
        self.taken.add(new)
        return new


def short_call_ids(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with every tool-call id (assistant ``tool_calls[].id``, tool
    ``tool_call_id``) as 9 alphanumerics; messages without ids are the same objects."""
    short = _Mapping()
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            message = {
                **message,
                "tool_calls": [
                    {**c, "id": short(c.get("id"))} if isinstance(c, dict) else c for c in calls
                ],
            }
        if "tool_call_id" in message:
            message = {**message, "tool_call_id": short(message["tool_call_id"])}
        out.append(message)
    return out
