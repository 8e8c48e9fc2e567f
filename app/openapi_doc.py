"""The OpenAPI document, stating what each route really sends.

Request bodies are the same pydantic models the routes validate with (the
routes read the raw body themselves, off the event loop, so the schemas are
attached here). Each route lists the statuses it answers with their real error
bodies (OpenAI's shape, or Anthropic's on /v1/messages), SSE responses as
``text/event-stream`` and /metrics as text. Bounds that depend on the loaded
model (messages per request) are filled in once it is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app.middleware import SAFE_METHODS
from app.settings import Settings

REF = "#/components/schemas/{model}"
OPENAI_ERROR = "OpenAIError"
ANTHROPIC_ERROR = "AnthropicError"
WHY = {
    400: "Invalid request: a field out of its bounds (named in the message), a prompt over "
    "the context or the memory budget, content this model cannot read, a "
    "previous_response_id no stored response has, or a Host header outside --allowed-hosts.",
    401: "Missing or wrong API key.",
    403: "Sent by a web page from an origin outside --cors-origins.",
    404: "No such stored response.",
    408: "The body paused longer than --body-timeout, or arrived slower than 256 KiB/s.",
    413: "Body larger than --max-body-bytes.",
    415: "A compressed body (Content-Encoding other than identity): send it uncompressed.",
    429: "The queue is full; retry after Retry-After seconds.",
    500: "The request failed in the engine (it alone: other requests go on).",
    503: "The model is loading, the server is shutting down, the request waited past "
    "--request-timeout, or the engine is down.",
}
RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying (absent when the engine is down).",
        "schema": {"type": "string"},
    }
}
IGNORED = {
    "X-Kvwarm-Ignored-Fields": {
        "description": "Request fields this server accepted but did not act on.",
        "schema": {"type": "string"},
    },
    "X-Conv-Id": {
        "description": "The conversation the KV cache filed this turn under.",
        "schema": {"type": "string"},
    },
    "X-Conv-KV": {
        "description": "What the KV cache did: hit (RAM), disk, fresh (new conversation), "
        "none (nothing reusable), disabled (use_kv_cache false or no cache), queued "
        "(streamed headers sent before admission).",
        "schema": {"enum": ["hit", "disk", "fresh", "none", "disabled", "queued"]},
    },
    "X-Conv-Cached-Tokens": {
        "description": "Prompt tokens whose KV was reused.",
        "schema": {"type": "string"},
    },
    "X-Conv-Processing-Tokens": {
        "description": "Prompt tokens run through the model.",
        "schema": {"type": "string"},
    },
}
_ERROR_SCHEMAS: dict[str, dict[str, Any]] = {
    OPENAI_ERROR: {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "code": {"type": ["string", "null"]},
                    "param": {"type": ["string", "null"]},
                },
            }
        },
    },
    ANTHROPIC_ERROR: {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
}


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def errors(error: str, statuses: Iterable[int]) -> dict[int | str, dict[str, Any]]:
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        doc: dict[str, Any] = {"description": WHY[status], "content": json_content(ref(error))}
        if status in (429, 503):
            doc["headers"] = RETRY_AFTER
        out[status] = doc
    return out


def generation_route(
    model: type[BaseModel],
    ok: dict[str, Any],
    *,
    error: str = OPENAI_ERROR,
    streams: bool = True,
    statuses: Iterable[int] = (400, 404, 413, 429, 500, 503),  # 404: an adapter unmounted
) -> dict[str, Any]:
    """Route kwargs for a POST whose JSON body is ``model``: the body schema,
    the 200 (JSON, and SSE when it streams) and the error statuses."""
    content = json_content(ok)
    if streams:
        content["text/event-stream"] = {}  # schema-free: clients read events, not a body
    return {
        "openapi_extra": {
            "requestBody": {"required": True, "content": json_content(ref(model.__name__))}
        },
        "responses": {
            200: {"description": "The result.", "content": content, "headers": IGNORED},
            **errors(error, statuses),
        },
    }


# The response bodies the routes build (the fields clients rely on; more may appear)
CHAT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "chat.completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": {"type": "object"},
    },
}
TEXT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "object": {"const": "text_completion"},
        "choices": {"type": "array", "items": {"type": "object"}},
    },
}
MESSAGE = {
    "type": "object",
    "required": ["id", "type", "role", "content", "stop_reason", "usage"],
    "properties": {
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "content": {"type": "array", "items": {"type": "object"}},
        "usage": {"type": "object"},
    },
}
RESPONSE = {
    "type": "object",
    "required": ["id", "object", "status", "output"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "response"},
        "status": {"type": "string"},
        "output": {"type": "array", "items": {"type": "object"}},
    },
}
DELETED = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {"id": {"type": "string"}, "deleted": {"const": True}},
}
ITEM_LIST = {
    "type": "object",
    "required": ["object", "data", "first_id", "last_id", "has_more"],
    "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": {"type": "object"}},
        "first_id": {"type": ["string", "null"]},
        "last_id": {"type": ["string", "null"]},
        "has_more": {"type": "boolean"},
    },
}
TOKEN_COUNT = {
    "type": "object",
    "required": ["input_tokens"],
    "properties": {"input_tokens": {"type": "integer", "minimum": 0}},
}
MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by", "context_length"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
        "context_length": {"type": "integer"},
        "max_model_context": {"type": "integer"},
        "parent": {"type": "string"},  # an adapter's base model
        "root": {"type": "string"},  # an adapter's directory
    },
}
MODELS = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL}},
}
HEALTH = {
    "type": "object",
    "required": ["status"],
    "properties": {
        "status": {"enum": ["ok", "loading", "stalled", "draining", "error"]},
        "error": {"type": ["string", "null"]},  # why the engine died (status error)
        "step_running_s": {"type": "number"},  # how long the stalled step has run
    },
}

# request lists whose length the loaded model bounds (see schemas.check_message_count)
_COUNTED = (
    ("ChatCompletionRequest", "messages"),
    ("CountTokensRequest", "messages"),
    ("MessagesRequest", "messages"),
    ("ResponsesRequest", "input"),
    ("CompletionRequest", "prompt"),
)
PROTECTED_EXEMPT = frozenset({"/health", "/metrics"})


def install_openapi(
    app: FastAPI,
    settings: Settings,
    models: Iterable[type[BaseModel]],
    context_length: Callable[[], int | None],
) -> None:
    """Replace FastAPI's generator with one that tells the truth about this server."""
    models = list(models)
    # the document while the model loads, built once: rebuilding it on every call
    # held the event loop ~25 ms each time
    loading: dict[str, Any] | None = None

    def build() -> dict[str, Any]:
        nonlocal loading
        if app.openapi_schema is not None:
            return app.openapi_schema
        limit = context_length()
        if limit is None:
            if loading is None:
                loading = document(None)
            return loading
        app.openapi_schema = document(limit)  # final once the model's bounds are in
        loading = None
        return app.openapi_schema

    def document(limit: int | None) -> dict[str, Any]:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
        components.update(defs.get("$defs", {}))
        components.update(_ERROR_SCHEMAS)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        if settings.api_key:
            doc["components"]["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            }
        checks_host = "*" not in settings.host_allowlist
        checks_origin = "*" not in settings.cors_allowlist
        for path, ops in doc.get("paths", {}).items():
            error = ANTHROPIC_ERROR if path.startswith("/v1/messages") else OPENAI_ERROR
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                # the middleware's answers, on any route it guards
                statuses = [400] if checks_host else []
                if checks_origin and method.upper() not in SAFE_METHODS:
                    statuses.append(403)
                if "requestBody" in op:
                    statuses += [408, 413, 415]
                for status, doc_ in errors(error, statuses).items():
                    responses.setdefault(str(status), doc_)
                if method == "head":  # its answers carry no body
                    for status, doc_ in responses.items():
                        responses[status] = {k: v for k, v in doc_.items() if k != "content"}
                if not settings.api_key:
                    continue
                if path in PROTECTED_EXEMPT:
                    op["security"] = []
                    continue
                op["security"] = [{"bearer": []}, {"apiKey": []}]
                responses["401"] = errors(error, [401])[401]
        if limit is not None:
            for model, field in _COUNTED:
                prop = components.get(model, {}).get("properties", {}).get(field, {})
                for branch in [prop, *prop.get("anyOf", ())]:
                    if branch.get("type") == "array" and "maxItems" not in branch:
                        branch["maxItems"] = limit
        return doc

    app.openapi = build  # type: ignore[method-assign]
