"""LoRA adapters mounted into the running server (mlx-bun's /v1/adapters).

POST /v1/adapters mounts an ``mlx_lm.lora`` adapter directory, GET lists the
mounted ones, DELETE /v1/adapters/{id} unmounts one. Mounting reads and checks
the files on the engine thread between two steps, so it never races a forward
pass; a request selects an adapter with ``"adapter": ID``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from pydantic import BaseModel, ConfigDict, Field

from app.body import parse_body
from app.engine_wait import engine_answer
from app.errors import APIError
from app.openapi_doc import OPENAI_ERROR, errors, json_content, ref
from app.settings import ADAPTER_ID
from app.state import AppState
from engine.adapter_files import never_fits_bytes, read_adapter_files, tensor_cap
from scheduler.admission import EngineUnavailable
from scheduler.contracts import (
    AdapterError,
    AdapterExists,
    AdapterInfo,
    AdapterInUse,
    AdapterNoRoomNow,
    AdapterNotFound,
    AdapterTooLarge,
)

router = APIRouter()


class AdapterMountRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str = Field(pattern=ADAPTER_ID.pattern, description="the name requests select it by")
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="directory holding adapter_config.json and adapters.safetensors "
        "(as mlx_lm.lora writes them), on the server's file system",
    )
    scale: float = Field(
        1.0,
        ge=0.0,
        le=16.0,
        allow_inf_nan=False,
        description="multiplier on the adapter's own lora_parameters.scale",
    )


ADAPTER = {
    "type": "object",
    "required": ["id", "object", "path", "rank", "scale", "size_bytes", "mounted_layers"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "adapter"},
        "path": {"type": "string"},
        "rank": {"type": "integer"},
        "scale": {"type": "number"},
        "lora_scale": {"type": "number"},
        "fine_tune_type": {"type": "string"},
        "size_bytes": {"type": "integer"},
        "mounted_layers": {"type": "integer"},
        "fingerprint": {"type": "string"},
    },
}
ADAPTER_LIST = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": ADAPTER}},
}
WHY = {
    400: "Invalid body, or an adapter that does not fit the model (the message names the "
    "layer and shapes), or one that leaves no memory for requests.",
    404: "No adapter is mounted under this id.",
    409: "Queued or running requests still use the adapter (unmount it when they finish), "
    "or another adapter is already mounted under this id.",
}


def _responses(ok: dict[str, Any], statuses: tuple[int, ...]) -> dict[int | str, Any]:
    out: dict[int | str, Any] = {200: {"description": "Done.", "content": json_content(ok)}}
    out.update(errors(OPENAI_ERROR, [503]))
    for status in statuses:
        out[status] = {"description": WHY[status], "content": json_content(ref(OPENAI_ERROR))}
    return out


async def _on_engine(state: AppState, future: Future[AdapterInfo]) -> AdapterInfo:
    try:
        return await engine_answer(state, future)
    except AdapterNotFound as exc:
        raise APIError(404, str(exc), code="adapter_not_found") from exc
    except AdapterInUse as exc:
        raise APIError(409, str(exc), code="adapter_in_use") from exc
    except AdapterExists as exc:
        raise APIError(409, str(exc), code="adapter_exists", param="id") from exc
    except AdapterTooLarge as exc:
        raise APIError(400, str(exc), code="adapter_over_budget", param="path") from exc
    except AdapterNoRoomNow as exc:  # fits once running or queued requests finish
        raise APIError(
            503, str(exc), "server_error", "adapter_no_room_now", headers={"Retry-After": "5"}
        ) from exc
    except AdapterError as exc:
        raise APIError(400, str(exc), code="invalid_adapter", param="path") from exc
    except EngineUnavailable as exc:
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        raise APIError(503, exc.message, "server_error", exc.code, headers=headers) from exc


@router.get("/v1/adapters", responses=_responses(ADAPTER_LIST, ()))
async def list_adapters(http: HTTPRequest) -> dict[str, Any]:
    state: AppState = http.app.state.kvwarm
    return {"object": "list", "data": [a.public() for a in state.engine.adapters()]}


@router.post(
    "/v1/adapters",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": json_content(ref(AdapterMountRequest.__name__)),
        }
    },
    responses=_responses(ADAPTER, (400, 409)),
)
async def mount(http: HTTPRequest) -> dict[str, Any]:
    state: AppState = http.app.state.kvwarm
    body: AdapterMountRequest = await state.preparer.body(
        http,
        lambda raw: parse_body(raw, AdapterMountRequest, state.model_info().context_length),
    )
    async with state.adapter_mounts:  # one file read and mounted at a time
        mounted = await _read_and_mount(state, body)
    state.adapters_seen.add(mounted.id)
    state.obs.adapter_mounted(mounted.id)  # an id unmounted before: its series again
    return mounted.public()


async def _read_and_mount(state: AppState, body: AdapterMountRequest) -> AdapterInfo:
    """Read the files and mount them (under the app's mount lock); the bytes read
    are dropped when this returns, before the next mount may read its own."""
    if any(a.id == body.id for a in state.engine.adapters()):  # before a byte is read
        raise APIError(
            409,
            f"an adapter {body.id!r} is already mounted; unmount it first",
            code="adapter_exists",
            param="id",
        )
    info = state.model_info()
    # nothing larger than the KV budget itself can fit: refused before it is read
    limit = never_fits_bytes(info.budget)
    cap = tensor_cap(info.adapter_layers)  # its header is checked here, not on the engine
    try:  # file reads and hashing: off the event loop and off the engine thread
        files = await asyncio.to_thread(read_adapter_files, Path(body.path), limit, cap)
    except AdapterTooLarge as exc:
        raise APIError(400, str(exc), code="adapter_over_budget", param="path") from exc
    except AdapterError as exc:
        raise APIError(400, str(exc), code="invalid_adapter", param="path") from exc
    return await _on_engine(state, state.engine.mount_adapter(body.id, files, body.scale))


@router.delete("/v1/adapters/{adapter_id}", responses=_responses(ADAPTER, (404, 409)))
async def unmount(adapter_id: str, http: HTTPRequest) -> dict[str, Any]:
    state: AppState = http.app.state.kvwarm
    info = await _on_engine(state, state.engine.unmount_adapter(adapter_id))
    state.obs.adapter_unmounted(adapter_id)
    return {**info.public(), "deleted": True}
