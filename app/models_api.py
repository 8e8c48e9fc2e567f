"""GET /v1/models: the loaded model and each mounted LoRA adapter (vLLM's shape);
GET /v1/models/{model}: one of them (OpenAI's "retrieve model")."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from app.errors import APIError
from app.openapi_doc import MODEL, MODELS, OPENAI_ERROR, errors, json_content, ref
from app.state import AppState

router = APIRouter()


def model_entries(state: AppState) -> list[dict[str, Any]]:
    """The base model first, then each mounted adapter."""
    info = state.model_info()
    # what one request may really use: clients size their context from this, and
    # a larger figure than the memory budget admits gets them a 400
    # context_over_budget; the model's own limit stays next to it
    usable = min(info.context_length, info.budget.ceiling_tokens)
    common = {
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "kvwarm",
        "context_length": usable,
        "max_model_context": info.context_length,
    }
    return [
        {"id": info.model_id, **common},
        *(
            {"id": a.id, **common, "parent": info.model_id, "root": a.path}
            for a in state.engine.adapters()
        ),
    ]


@router.get(
    "/v1/models",
    responses={
        200: {"description": "The loaded model.", "content": json_content(MODELS)},
        **errors(OPENAI_ERROR, [503]),
    },
)
async def list_models(http: HTTPRequest) -> dict[str, Any]:
    return {"object": "list", "data": model_entries(http.app.state.kvwarm)}


@router.get(
    # path: hub ids hold a "/" (org/name), and so may the path a model was served from
    "/v1/models/{model:path}",
    responses={
        200: {"description": "The model or mounted adapter.", "content": json_content(MODEL)},
        404: {
            "description": "No model or mounted adapter has this id.",
            "content": json_content(ref(OPENAI_ERROR)),
        },
        **errors(OPENAI_ERROR, [503]),
    },
)
async def retrieve_model(model: str, http: HTTPRequest) -> dict[str, Any]:
    for entry in model_entries(http.app.state.kvwarm):
        if entry["id"] == model:
            return entry
    raise APIError(
        404,
        f"The model {model!r} does not exist; GET /v1/models lists those served.",
        param="model",
        code="model_not_found",
    )
