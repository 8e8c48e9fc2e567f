"""Conversation KV save/load (for people who resume work later).

POST /v1/conv_kv/save pins a conversation's KV on disk beyond eviction,
POST /v1/conv_kv/load starts bringing it back into RAM ahead of the next turn
(answered at once, tier ``loading`` while the reader thread reads its files),
GET /v1/conv_kv/stats lists the saved ones, DELETE /v1/conv_kv/{id} forgets one
(any id but those three names). An id the server derived (``auto-``) is shared by
every client without one of its own whose prompt starts alike: it loads (that only
warms the cache) but is never saved nor deleted (one client's save or delete
would take the others' KV).
The KV manager does the work on the engine thread; these routes only wait.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Path
from fastapi import Request as HTTPRequest
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.convertors import PathConvertor, register_url_convertor

from app.body import parse_body
from app.engine_wait import engine_answer
from app.errors import APIError
from app.openapi_doc import OPENAI_ERROR, errors, json_content, ref
from app.session_id import MAX_LEN, client_id
from app.state import AppState
from kvcache.interface import (
    ConversationNotFound,
    KVCacheDisabled,
    KVCacheManager,
    SavedConversation,
    StorageFull,
)
from kvcache.sessions import DERIVED_PREFIX, is_derived_id
from scheduler.admission import EngineUnavailable

router = APIRouter()
T = TypeVar("T")
# this router's own resources: never a conversation id in DELETE /v1/conv_kv/{id}
RESERVED = ("save", "load", "stats")


class ConversationIdConvertor(PathConvertor):
    """Any path (ids hold "/": "team/alice") but a reserved name: DELETE
    /v1/conv_kv/save reached the delete handler (a 400 "prefix cache is off")
    where routing, Allow and the document all say POST only (a 405)."""

    regex = rf"(?!(?:{'|'.join(RESERVED)})$).*"


register_url_convertor("conversation_id", ConversationIdConvertor())

_STRICT = ConfigDict(extra="forbid", strict=True)


def _as_chat_reads_it(value: object) -> object:
    """The id a chat request naming ``value`` gets (5 is "5", spaces around are
    dropped, bounded): other values stay, for the schema to refuse."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return value
    return client_id(value) or ""


ConversationId = Annotated[
    str,
    BeforeValidator(_as_chat_reads_it, json_schema_input_type=str | int),
    # no maxLength: a longer id is cut to its first MAX_LEN characters, as in chat
    Field(
        min_length=1,
        description=f"As chat requests read it: an integer is its digits, spaces around "
        f"it are dropped, and only its first {MAX_LEN} characters count.",
    ),
]


class ConvSaveRequest(BaseModel):
    model_config = _STRICT
    conversation_id: ConversationId
    title: str | None = Field(None, max_length=256)


class ConvLoadRequest(BaseModel):
    model_config = _STRICT
    conversation_id: ConversationId


SAVED = {
    "type": "object",
    "required": ["conversation_id", "tokens", "bytes", "tier"],
    "properties": {
        "conversation_id": {"type": "string"},
        "title": {"type": ["string", "null"]},
        "tokens": {"type": "integer"},
        "bytes": {"type": "integer"},
        "tier": {
            "type": "string",
            "description": (
                "Where its KV is: ram, disk, ram+disk, writing (its write queued), "
                "loading (a load under way)."
            ),
        },
        "saved_at": {"type": ["number", "null"]},
    },
}
SAVED_LIST = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": SAVED}},
}
WHY = {
    400: "Invalid body, the prefix cache is off (--prompt-cache-bytes 0), or a save or "
    f"delete names an id the server derived ({DERIVED_PREFIX}...), which many clients share.",
    404: "No cached KV for this conversation id.",
    507: "The SSD tier is off or full (the message names the limit).",
}
# DELETE on a reserved name: that path is another route, which Allow names
GONE_ELSEWHERE = {
    "description": f"The id is one of {', '.join(RESERVED)}: that path is another route, "
    "whose method the Allow header names.",
    "headers": {"Allow": {"schema": {"type": "string"}}},
    "content": json_content(ref(OPENAI_ERROR)),
}


def _responses(ok: dict[str, Any], statuses: tuple[int, ...]) -> dict[int | str, Any]:
    out: dict[int | str, Any] = {200: {"description": "Done.", "content": json_content(ok)}}
    for status, doc in errors(OPENAI_ERROR, [s for s in statuses if s in (503,)]).items():
        out[status] = doc
    for status in statuses:
        if status in WHY:
            out[status] = {"description": WHY[status], "content": json_content(ref(OPENAI_ERROR))}
    return out


def _body(model: type[BaseModel]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": json_content(ref(model.__name__))}}


async def _on_engine(http: HTTPRequest, op: Callable[[KVCacheManager], T]) -> T:
    state: AppState = http.app.state.kvwarm
    try:
        return await engine_answer(state, state.engine.kv(op))
    except ConversationNotFound as exc:
        raise APIError(404, str(exc), code="conversation_not_found") from exc
    except StorageFull as exc:
        raise APIError(507, str(exc), "server_error", "insufficient_storage") from exc
    except KVCacheDisabled as exc:
        raise APIError(400, str(exc), code="prompt_cache_disabled") from exc
    except EngineUnavailable as exc:
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        raise APIError(503, exc.message, "server_error", exc.code, headers=headers) from exc


def _derived(conversation_id: str) -> APIError:
    return APIError(
        400,
        f"{conversation_id!r} is an id the server derived from the prompt's first 128 "
        "tokens: every client that names no conversation and whose prompt starts alike "
        "shares it, so it is never saved or deleted (it may be loaded). Send "
        "conversation_id (or session_id; top level, in metadata or in extra_body) or an "
        "X-Session-Id header with your requests to get a conversation of your own.",
        code="derived_conversation_id",
        param="conversation_id",
    )


def _forget(conversation_id: str) -> Callable[[KVCacheManager], SavedConversation | None]:
    """Delete ``conversation_id``; None (refused) for a derived id, unless an earlier
    version saved it: its pin would hold its disk for good."""

    def op(kv: KVCacheManager) -> SavedConversation | None:
        if is_derived_id(conversation_id) and conversation_id not in {
            s.conversation_id for s in kv.saved_conversations()
        }:
            return None
        return kv.delete_conversation(conversation_id)

    return op


def _view(saved: SavedConversation) -> dict[str, Any]:
    return asdict(saved)


async def _parsed(http: HTTPRequest, model: type[BaseModel]) -> Any:
    state: AppState = http.app.state.kvwarm
    return await state.preparer.body(
        http, lambda raw: parse_body(raw, model, state.model_info().context_length)
    )


@router.post(
    "/v1/conv_kv/save",
    openapi_extra=_body(ConvSaveRequest),
    responses=_responses(SAVED, (400, 404, 503, 507)),
)
async def save(http: HTTPRequest) -> dict[str, Any]:
    body: ConvSaveRequest = await _parsed(http, ConvSaveRequest)
    if is_derived_id(body.conversation_id):
        raise _derived(body.conversation_id)
    saved = await _on_engine(
        http, lambda kv: kv.save_conversation(body.conversation_id, body.title)
    )
    return _view(saved)


@router.post(
    "/v1/conv_kv/load",
    openapi_extra=_body(ConvLoadRequest),
    responses=_responses(SAVED, (400, 404, 503)),
)
async def load(http: HTTPRequest) -> dict[str, Any]:
    body: ConvLoadRequest = await _parsed(http, ConvLoadRequest)
    loaded = await _on_engine(http, lambda kv: kv.load_conversation(body.conversation_id))
    return _view(loaded)


@router.get("/v1/conv_kv/stats", responses=_responses(SAVED_LIST, (400, 503)))
async def stats(http: HTTPRequest) -> dict[str, Any]:
    saved = await _on_engine(http, lambda kv: kv.saved_conversations())
    return {"object": "list", "data": [_view(s) for s in saved]}


@router.delete(
    "/v1/conv_kv/{conversation_id:conversation_id}",
    responses={**_responses(SAVED, (400, 404, 503)), 405: GONE_ELSEWHERE},
)
async def delete(
    http: HTTPRequest,
    conversation_id: str = Path(json_schema_extra={"not": {"enum": list(RESERVED)}}),
) -> dict[str, Any]:
    conversation_id = client_id(conversation_id) or ""  # as save and load read theirs
    if not conversation_id:
        raise APIError(400, "The conversation id is blank.", param="conversation_id")
    deleted = await _on_engine(http, _forget(conversation_id))
    if deleted is None:
        raise _derived(conversation_id)
    return {**_view(deleted), "deleted": True}
