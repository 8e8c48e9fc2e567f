"""Where agents put their conversation id: body fields, ``metadata``,
``extra_body`` (some SDKs forward it verbatim) or an ``X-Session-Id`` header."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

SESSION_FIELDS = (
    "session_id",
    "conversation_id",
    "conversation",  # a string, or {"id": ...} (OpenAI Responses)
    "thread_id",
    "chat_id",
)
# OpenAI's own field for "requests that share a prefix": Codex sets it to its
# conversation id, but OpenAI suggests one key for many users of an app, who as
# one session would share its few branches: read only when nothing names one
CACHE_KEY_FIELD = "prompt_cache_key"
# Codex sends session_id / conversation_id headers without the x- prefix
SESSION_HEADERS = ("x-session-id", "x-conversation-id", "session_id", "conversation_id")
# Claude Code's metadata.user_id: "user_<hash>_account_<id>_session_<uuid>", and since
# v2.1.78 a JSON object {"device_id", "account_uuid", "session_id"} as a string
_CLAUDE_CODE_USER = "_session_"
MAX_USER_ID_JSON = 4096
MAX_LEN = 256


def _bounded(value: str) -> str:
    """A session id as valid text of bounded length. JSON escapes may name a lone
    surrogate (metadata.user_id is JSON this module parses itself; a client cutting
    a string inside an emoji makes one): kept, such an id failed every use that
    encodes it (healing's scope hash, the trace file, the span export) after the
    reply was generated. Escaped rather than dropped or refused: such ids stay
    apart from each other (one spelling the escape out in plain text joins it, as
    a client may name any session anyway)."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8")[:MAX_LEN]


def _from_mapping(
    data: Mapping[str, Any] | None, fields: tuple[str, ...] = SESSION_FIELDS
) -> str | None:
    if not isinstance(data, Mapping):
        return None
    for name in fields:
        value = data.get(name)
        if isinstance(value, Mapping):
            value = value.get("id")
        if isinstance(value, (str, int)) and str(value).strip():
            return _bounded(str(value).strip())
    return None


def session_id_from(
    body: Mapping[str, Any], headers: Mapping[str, str], cache_key: bool = True
) -> str | None:
    """The client's session id, or None (the cache then groups by prompt head);
    ``cache_key`` False: a conversation's own id only, never a prompt_cache_key
    (one app's key, perhaps, shared by all its users)."""
    for source in (body, body.get("metadata"), body.get("extra_body")):
        found = _from_mapping(source)
        if found:
            return found
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    if isinstance(user, str):
        found = _claude_code_session(user)
        if found:
            return found
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value and value.strip():
            return _bounded(value.strip())
    if not cache_key:
        return None
    for source in (body, body.get("metadata"), body.get("extra_body")):
        found = _from_mapping(source, (CACHE_KEY_FIELD,))
        if found:
            return found
    return None


def _claude_code_session(user: str) -> str | None:
    text = user.strip()
    if text.startswith("{") and len(text) <= MAX_USER_ID_JSON:
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        found = _from_mapping(parsed) if isinstance(parsed, Mapping) else None
        if found:
            return found
    if _CLAUDE_CODE_USER in text:
        return _bounded(text.rsplit(_CLAUDE_CODE_USER, 1)[1].strip()) or None
    return None
