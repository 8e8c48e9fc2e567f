"""A Responses request's input items beyond their rendering: ``item_reference``
resolved from the store, hosted tools' items skipped (and said), and the items
kept as OpenAI lists them (GET /v1/responses/{id}/input_items)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal, NamedTuple

from fastapi import APIRouter, Query
from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from pydantic import TypeAdapter, ValidationError

from app.body import BodyLimits
from app.errors import APIError
from app.generation import new_id
from app.openapi_doc import ITEM_LIST, OPENAI_ERROR, errors, json_content
from app.response_store import ResponseStore, StoredResponse
from app.responses_schemas import (
    HostedItem,
    InputItem,
    ItemReference,
    MessageItem,
    ReasoningItem,
)

_INPUT_ITEM: TypeAdapter[Any] = TypeAdapter(InputItem)

# an item's id as OpenAI spells it, by type
_ID_PREFIX = {
    "message": "msg",
    "reasoning": "rs",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
}


def holders(
    items: str | list[Any] | None, store: ResponseStore, max_bytes: int, limits: BodyLimits
) -> dict[str, StoredResponse]:
    """The stored response holding each referenced item (the store is the event
    loop's; its items are read in a worker thread); 400 naming an unknown one,
    and 400 when what the references name is more than a body may carry: each
    is a copy of its item, and a 13 KB body naming a 1 MiB item 300 times made
    300 MiB of prompt. Weighed from the store's index, nothing parsed."""
    found: dict[str, StoredResponse] = {}
    nbytes = values = 0
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if not isinstance(item, ItemReference):
            continue
        holder = found.get(item.id) or store.holding(item.id)
        if holder is None:
            raise APIError(
                400,
                f"Item with id '{item.id}' not found: no response this server stores holds it.",
                code="item_not_found",
                param=f"input.{i}",
            )
        found[item.id] = holder
        slot = holder.index[item.id]
        nbytes, values = nbytes + slot.nbytes, values + slot.values
    if nbytes > max_bytes or values > limits.max_values:
        raise APIError(
            400,
            f"The items input's item_references name are {nbytes} bytes of JSON ({values} values), "
            f"more than one request may carry (at most {max_bytes} bytes and "
            f"{limits.max_values} values); send fewer references.",
            code="item_references_too_large",
            param="input",
        )
    return found


def resolved(items: str | list[Any], found: Mapping[str, StoredResponse]) -> str | list[Any]:
    """Each ``item_reference`` replaced by the item it names (a worker thread's
    job): each item parsed once, and each holder's output at most once, however
    many references name them."""
    if isinstance(items, str):
        return items
    read: dict[str, Any] = {}  # item id -> the item (read only after: shared is safe)
    outputs: dict[int, list[Any]] = {}  # a holder's parsed output
    out = []
    for i, item in enumerate(items):
        if isinstance(item, ItemReference):
            if item.id not in read:
                stored = found[item.id].item(item.id, outputs)
                try:  # what was stored was validated: only a store gone wrong fails here
                    read[item.id] = _INPUT_ITEM.validate_python(stored)
                except ValidationError as exc:
                    message = f"Item '{item.id}' cannot be read back from the store."
                    raise APIError(500, message, "server_error", param=f"input.{i}") from exc
            item = read[item.id]
        out.append(item)
    return out


def skipped(items: str | list[Any]) -> tuple[str, ...]:
    """Hosted tools' items (nothing here ran them): named, as ignored tools are."""
    if isinstance(items, str):
        return ()
    return tuple(dict.fromkeys(f"input.{i.type}" for i in items if isinstance(i, HostedItem)))


class Listed(NamedTuple):
    items: list[dict[str, Any]]
    minted: frozenset[str]  # the ids made here: only these name an item to a reference


def listed(items: str | list[Any]) -> Listed:
    """The input items as OpenAI lists them: each with an id (the client's, else a
    new one), a message's text as parts (a worker thread's job). An id already
    given to an item (a client's sent twice, two references to one stored item)
    is the first's; the next gets a new one. The listing's cursor is an id: under
    a shared one, the page after the second item was the one after the first, and a
    client following has_more paged forever. OpenAI refuses such input with a 400;
    kvwarm accepted it before, and still does."""
    if isinstance(items, str):
        items = [MessageItem(content=items)]
    out = []
    minted: set[str] = set()
    given: set[str] = set()
    for item in items:
        if isinstance(item, HostedItem):
            shown = item.model_dump(exclude_none=True)  # its fields were never read
        else:  # the fields read, not a client's extra keys
            shown = item.model_dump(include=set(type(item).model_fields), exclude_none=True)
        if item.id is None or item.id in given:
            shown["id"] = new_id(_ID_PREFIX.get(item.type, "item"))
            minted.add(shown["id"])
        else:
            shown["id"] = item.id
        given.add(shown["id"])
        if isinstance(item, MessageItem):
            shown["content"] = _message_parts(item)
        if not isinstance(item, (HostedItem, ReasoningItem)):
            shown["status"] = "completed"  # what the SDK's listed items carry
        out.append(shown)
    return Listed(out, frozenset(minted))


def _message_parts(item: MessageItem) -> list[dict[str, Any]]:
    said = item.role == "assistant"
    if isinstance(item.content, str):
        part: dict[str, Any] = {"type": "output_text" if said else "input_text"}
        parts = [{**part, "text": item.content}]
    else:
        parts = [p.model_dump(exclude_none=True) for p in item.content]
    for p in parts:
        if p["type"] == "output_text":
            p.setdefault("annotations", [])  # the SDK's output text always has them
    return parts


def page(
    stored: StoredResponse, order: str, limit: int, after: str | None
) -> tuple[list[bytes], list[str], bool]:
    """One page of a stored response's input items: their JSON, their ids, and
    whether more follow."""
    ids = list(stored.item_ids)
    at = list(range(len(ids)))
    if order == "desc":
        at.reverse()
    if after is not None:
        if after not in ids:
            raise APIError(400, f"No input item '{after}' in this response.", param="after")
        at = at[at.index(ids.index(after)) + 1 :]
    chosen = at[:limit]
    return [stored.item_json(i) for i in chosen], [ids[i] for i in chosen], len(at) > limit


def listing(stored: StoredResponse, order: str, limit: int, after: str | None) -> bytes:
    """OpenAI's list object, from the items' stored JSON (nothing parsed)."""
    data, ids, more = page(stored, order, limit, after)
    first, last = (ids[0], ids[-1]) if ids else (None, None)
    tail = {"first_id": first, "last_id": last, "has_more": more}
    return (
        b'{"object":"list","data":['
        + b",".join(data)
        + b"],"
        + json.dumps(tail, separators=(",", ":"))[1:].encode()
    )


router = APIRouter()


def response_not_found(response_id: str) -> APIError:
    """A stored response this server does not hold (never stored, expired, deleted)."""
    return APIError(404, f"Response with id '{response_id}' not found.", code="not_found")


@router.get(
    "/v1/responses/{response_id}/input_items",
    responses={
        200: {
            "description": "A stored response's input items.",
            "content": json_content(ITEM_LIST),
        },
        **errors(OPENAI_ERROR, [400, 404]),
    },
)
async def list_input_items(
    response_id: str,
    http: HTTPRequest,
    order: Literal["asc", "desc"] = "desc",
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=256)] = None,
) -> Response:
    stored = http.app.state.kvwarm.responses.get(response_id)
    if stored is None:
        raise response_not_found(response_id)
    return Response(listing(stored, order, limit, after), media_type="application/json")
