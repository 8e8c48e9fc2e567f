"""Every error leaves as {"error": {"message", "type", "code"}} with the right status."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import from_json
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from observability.escape import ascii_escaped
from scheduler.admission import AdmissionError, ContextLengthExceeded, EngineUnavailable

log = logging.getLogger("kvwarm.http")
INVALID_REQUEST = "invalid_request"  # the code of every 400 that refuses a request field


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        error_type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        if code is None and status == 400 and param is not None:
            # a refused request field: the code the schema's own refusals carry
            # (app.body.parse_body), so clients check one code, not that or null
            code = INVALID_REQUEST
        self.code = code
        self.param = param
        self.headers = headers
        # the request was accepted and is already counted as finished (in error):
        # /metrics does not count it again as refused
        self.recorded = False


def error_body(message: str, error_type: str, code: str | None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "code": code, "param": param}}


ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    error_type = _ANTHROPIC_TYPES.get(
        status, "api_error" if status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_payload(
    path: str,
    status: int,
    message: str,
    error_type: str,
    code: str | None,
    param: str | None = None,
) -> dict:
    """The error body in the dialect of the route that failed."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_body(status, message)
    return error_body(message, error_type, code, param)


def error_response(
    status: int,
    message: str,
    error_type: str,
    code: str | None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "",
    logged: bool = False,
) -> JSONResponse:
    body = error_payload(path, status, message, error_type, code, param)
    if not logged:
        level = logging.WARNING if status >= 500 else logging.INFO
        log.log(level, "%s -> %d %s: %s", path or "?", status, code or error_type, message)
    return JSONResponse(body, status, headers=headers)


# The engine is down for good (it died; not loading, not draining): no retry can
# succeed until someone restarts the server, yet the anthropic and openai SDKs (and
# Claude Code) retry every 503 unless this header tells them not to.
ENGINE_DOWN_CODE = EngineUnavailable.code
NO_RETRY = {"x-should-retry": "false"}


def from_admission(exc: AdmissionError) -> APIError:
    retry_after = getattr(exc, "retry_after", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    if isinstance(exc, EngineUnavailable) and exc.code == ENGINE_DOWN_CODE:
        headers = {**(headers or {}), **NO_RETRY}
    return APIError(exc.status, exc.message, exc.error_type, exc.code, headers=headers)


def _loc_part(part: Any) -> str | None:
    """A location step as the client wrote it (pydantic adds union-branch tags)."""
    if isinstance(part, int):
        return str(part)
    if isinstance(part, str) and part != "body" and not any(c in part for c in "[]()"):
        return part
    return None


_ABSENT = object()


def client_path(loc: Sequence[Any], document: Any = _ABSENT, missing: bool = False) -> list[str]:
    """``loc`` as a path in the client's own document. pydantic's locations also
    name the union branch tried ("str", "CustomTool", a discriminator's value):
    walked along the document, a step that is no key or index of it is such a
    tag, unless it is the last step of a ``missing`` error (the field that is
    absent)."""
    if document is _ABSENT:
        return [p for p in map(_loc_part, loc) if p is not None]
    path: list[str] = []
    node = document
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, dict) and isinstance(part, str):
            if not last and part == node.get("type") and _is_tag(node, part, loc[i + 1]):
                continue  # a tagged union's branch that is also a key ("text": ...)
            if part in node:
                node = node[part]
            elif not (last and missing):
                continue  # a branch tag
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            continue  # a branch tag
        path.append(str(part))
    return path


def _is_tag(node: dict[str, Any], part: str, following: Any) -> bool:
    """``part``, the object's own type and also one of its keys, is its tagged
    union's branch when the next step is a key here rather than inside it."""
    inner = node.get(part)
    return following in node and not (isinstance(inner, dict) and following in inner)


MAX_DETAIL = 300  # characters of one validation message: never a client's megabytes back


def describe_errors(errors: Sequence[Any], body: bytes | None = None) -> tuple[str, str | None]:
    """A validation failure as one message naming the field, and that field.
    Given the JSON ``body``, the error named is the one deepest in it: of a
    union's failed branches, the one closest to what the client wrote."""
    if not errors:
        return "Invalid request body.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "") or first.get("msg", "")
        return f"Request body is not valid JSON: {detail}".strip(), None
    document = _ABSENT
    if body is not None:
        try:
            # parsed again only on this failure path, by the validator's own parser
            # (json.loads held the GIL twice as long on a 30 MB body)
            document = from_json(body)
        except (ValueError, RecursionError):
            pass
    paths = [client_path(e.get("loc", ()), document, e.get("type") == "missing") for e in errors]
    # deepest first; on a tie, a broken bound over a branch of the wrong type
    deepest = (
        max(
            range(len(errors)),
            key=lambda i: (len(paths[i]), not str(errors[i].get("type", "")).endswith("_type")),
        )
        if document is not _ABSENT
        else 0
    )
    chosen = errors[deepest]
    param = ".".join(paths[deepest]) or None
    where = f" at '{param}'" if param else ""
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    value = chosen.get("input")
    got = f" (got {value!r:.60})" if isinstance(value, (str, int, float, bool)) else ""
    msg = str(chosen.get("msg", "invalid value"))
    if len(msg) > MAX_DETAIL:  # a validator's message quoting what the client sent
        msg = msg[:MAX_DETAIL] + "..."
    return f"Invalid request{where}: {msg}{got}{more}", param


_STATUS_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}


def rejection_reason(status: int, code: str | None) -> str | None:
    """How /metrics files a refused generation request."""
    if code == "context_length_exceeded":
        return "over_context"
    if code == "context_over_budget":
        return "over_budget"
    if status == 429:
        return "queue_full"
    if status == 503:
        return "unavailable"
    if status in (400, 413, 415, 422):
        return "invalid"
    if status == 408:
        return "body_timeout"
    return None


# the routes whose refusals are requests_rejected_total (not adapter or KV admin calls)
GENERATION_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"}
)


def count_refusal(scope: Scope, status: int, code: str | None) -> None:
    """Count a refused generation request in /metrics (also for the middleware's
    refusals, which no exception handler sees)."""
    app = scope.get("app")
    state = getattr(app.state, "kvwarm", None) if app is not None else None
    reason = rejection_reason(status, code)
    generation = scope.get("method") == "POST" and scope.get("path") in GENERATION_PATHS
    if state is not None and reason and generation:
        info = state.engine.model_info
        state.obs.metrics.observe_rejection(reason, info.model_id if info else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if not exc.recorded:
            count_refusal(request.scope, exc.status, exc.code)
        return error_response(
            exc.status,
            exc.message,
            exc.error_type,
            exc.code,
            exc.param,
            exc.headers,
            path=request.url.path,
        )

    @app.exception_handler(AdmissionError)
    async def _admission(request: Request, exc: AdmissionError) -> JSONResponse:
        err = from_admission(exc)
        count_refusal(request.scope, err.status, err.code)
        message = err.message
        if isinstance(exc, ContextLengthExceeded) and request.url.path.startswith(ANTHROPIC_PATHS):
            message = exc.anthropic_message
        return error_response(
            err.status,
            message,
            err.error_type,
            err.code,
            headers=err.headers,
            path=request.url.path,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_errors(exc.errors())
        count_refusal(request.scope, 400, INVALID_REQUEST)
        return error_response(
            400, message, "invalid_request_error", INVALID_REQUEST, param, path=request.url.path
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(getattr(exc, "headers", None) or {})
        count_refusal(request.scope, exc.status_code, None)  # a body too large or too slow
        if exc.status_code == 405:
            # with Starlette's own list: an empty Allow tells a client nothing is allowed
            listed = {m.strip() for m in headers.get("Allow", "").split(",") if m.strip()}
            found = listed | set(allowed_methods(request.app, request.scope))
            if found:
                headers["Allow"] = ", ".join(sorted(found))
        return error_response(
            exc.status_code,
            str(exc.detail),
            _STATUS_TYPES.get(exc.status_code, "invalid_request_error"),
            None,
            headers=headers or None,
            path=request.url.path,
        )


def _served_routes(routes: Iterable[Any]) -> Iterator[Any]:
    """Every route, those of included routers too: recent FastAPI keeps an
    included router as one entry (no ``methods``), whose routes it yields."""
    for route in routes:
        contexts = getattr(route, "effective_route_contexts", None)
        if callable(contexts):
            yield from contexts()
        else:
            yield route


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method the routes of this path serve (Starlette's 405 names only the
    first matching route's)."""
    path = get_route_path(scope)
    methods: set[str] = set()
    for route in _served_routes(app.router.routes):
        regex = getattr(route, "path_regex", None)
        route_methods = getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(path):
            methods |= set(route_methods)
    return sorted(methods)


class InternalErrorMiddleware:
    """A 500 in the route's dialect for anything unexpected, logged once.

    Starlette's handler for ``Exception`` answers and then re-raises, so the
    server logged every 500 a second time; this catches it first."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        # percent-decoded client text (a route's path parameter): escaped for the log
        path = ascii_escaped(scope["path"], 256)
        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:  # hung up before its body arrived: nobody to answer
            log.info("%s %s: the client left before sending its body", scope.get("method"), path)
            return
        except Exception as exc:  # noqa: BLE001 - the one place unexpected errors end
            log.exception("unhandled error on %s %s", scope.get("method"), path)
            if started:  # a stream already under way: nothing more can be said
                return
            response = error_response(
                500,
                f"Internal server error: {exc}",
                "server_error",
                "internal_error",
                path=scope["path"],
                logged=True,
            )
            await response(scope, receive, send)
