"""Where agents put their conversation id: body fields, ``metadata``,
``extra_body`` (some SDKs forward it verbatim) or an ``X-Session-Id`` header."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from app.errors import APIError
from kvcache.sessions import DERIVED_PREFIX, is_derived_id

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


def client_id(value: object) -> str | None:
    """A conversation id as a client sent it, the way every route reads it: a
    string or an integer, surrounding spaces stripped, bounded; None when blank or
    of another type."""
    if isinstance(value, (str, int)) and str(value).strip():
        return _bounded(str(value).strip())
    return None


def _own(found: str | None, param: str | None) -> str | None:
    # kvcache.sessions.fallback_session_id's ids: the head of a prompt, which every
    # client without an id of its own that starts alike shares; no client may name one
    if found is not None and is_derived_id(found):
        raise APIError(
            400,
            f"Conversation ids of the form {DERIVED_PREFIX}<16 hex digits> are reserved: "
            "they are the ids the server derives for requests that name none, shared by "
            "every client whose prompt starts alike. Choose another id.",
            code="reserved_conversation_id",
            param=param,
        )
    return found


def _from_mapping(
    data: Mapping[str, Any] | None, fields: tuple[str, ...] = SESSION_FIELDS
) -> tuple[str, str] | None:
    """The first of ``fields`` naming an id: (the id, the field)."""
    if not isinstance(data, Mapping):
        return None
    for name in fields:
        value = data.get(name)
        if isinstance(value, Mapping):
            value = value.get("id")
        found = client_id(value)
        if found:
            return found, name
    return None


def session_id_from(
    body: Mapping[str, Any], headers: Mapping[str, str], cache_key: bool = True
) -> str | None:
    """The client's session id, or None (the cache then groups by prompt head);
    ``cache_key`` False: a conversation's own id only, never a prompt_cache_key
    (one app's key, perhaps, shared by all its users). An id beginning
    derived id's shape is a 400 (APIError): it would join derived conversations."""
    sources = (
        ("", body),
        ("metadata.", body.get("metadata")),
        ("extra_body.", body.get("extra_body")),
    )
    for where, source in sources:
        named = _from_mapping(source)
        if named:
            return _own(named[0], where + named[1])
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    if isinstance(user, str):
        found = _own(_claude_code_session(user), "metadata.user_id")
        if found:
            return found
    for name in SESSION_HEADERS:
        found = _own(client_id(headers.get(name)), None)
        if found:
            return found
    if not cache_key:
        return None
    for where, source in sources:
        named = _from_mapping(source, (CACHE_KEY_FIELD,))
        if named:
            return _own(named[0], where + named[1])
    return None


def _claude_code_session(user: str) -> str | None:
    text = user.strip()
    if text.startswith("{") and len(text) <= MAX_USER_ID_JSON:
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        named = _from_mapping(parsed) if isinstance(parsed, Mapping) else None
        if named:
            return named[0]
    if _CLAUDE_CODE_USER in text:
        return _bounded(text.rsplit(_CLAUDE_CODE_USER, 1)[1].strip()) or None
    return None
