"""Where agents put their conversation id: body fields, ``metadata``,
``extra_body`` (some SDKs forward it verbatim) or an ``X-Session-Id`` header."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SESSION_FIELDS = ("session_id", "conversation_id", "thread_id", "chat_id")
SESSION_HEADERS = ("x-session-id", "x-conversation-id")
MAX_LEN = 256


def _from_mapping(data: Mapping[str, Any] | None) -> str | None:
    if not isinstance(data, Mapping):
        return None
    for name in SESSION_FIELDS:
        value = data.get(name)
        if isinstance(value, (str, int)) and str(value).strip():
            return str(value).strip()[:MAX_LEN]
    return None


def session_id_from(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The client's session id, or None (the cache then groups by prompt head)."""
    for source in (body, body.get("metadata"), body.get("extra_body")):
        found = _from_mapping(source)
        if found:
            return found
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value and value.strip():
            return value.strip()[:MAX_LEN]
    return None
