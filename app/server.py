"""FastAPI app + lifespan: builds the scheduler, starts the engine thread."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from app.adapters_api import AdapterMountRequest
from app.adapters_api import router as adapters_router
from app.anthropic_messages import router as messages_router
from app.anthropic_schemas import CountTokensRequest, MessagesRequest
from app.conv_kv import ConvLoadRequest, ConvSaveRequest
from app.conv_kv import router as conv_kv_router
from app.errors import InternalErrorMiddleware, install_error_handlers
from app.fit_api import router as fit_router
from app.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    CrossOriginGuard,
    HostCheckMiddleware,
    OpenRequests,
    PreflightCORS,
    RequestCounter,
    RequestIdHeader,
)
from app.models_api import router as models_router
from app.openai_chat import router as chat_router
from app.openai_completions import router as completions_router
from app.openai_responses import router as responses_router
from app.openapi_doc import (
    HEALTH,
    RETRY_AFTER,
    install_openapi,
    json_content,
)
from app.responses_schemas import ResponsesRequest
from app.schemas import ChatCompletionRequest, CompletionRequest
from app.settings import Settings
from app.state import AppState
from observability.hub import Observability
from observability.metrics import CONTENT_TYPE
from scheduler.admission import RETRY_AFTER_S
from scheduler.contracts import EngineHandle
from scheduler.scheduler import Scheduler
from scheduler.service import GenerationService
from scheduler.streams import OutputRouter

log = logging.getLogger("kvwarm.http")
RETRY_LATER = {"Retry-After": str(RETRY_AFTER_S)}
# how long the exit waits for the engine thread (its last step, queued KV writes);
# one still busy then (a model load, a long step) is left: app.lifecycle.leave
ENGINE_JOIN_S = 20.0


class StartableEngine(EngineHandle, Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def is_alive(self) -> bool: ...


EngineFactory = Callable[[Scheduler, OutputRouter], StartableEngine]


def create_app(settings: Settings, engine_factory: EngineFactory) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router = OutputRouter(asyncio.get_running_loop())
        scheduler = Scheduler(
            None,
            max_running=settings.batch,
            max_queue=settings.max_queue,
            request_timeout_s=settings.request_timeout,
            max_image_bytes=int(settings.max_image_inputs_bytes),
        )
        engine = engine_factory(scheduler, router)
        state = AppState(settings, engine, GenerationService(scheduler, router, engine))
        state.obs = Observability(state.snapshot, settings.cache_trace_dir)
        log.info("telemetry: %s", state.obs.tracing.describe())
        app.state.kvwarm = state
        engine.start()
        freezer = asyncio.create_task(_freeze_startup_objects(engine))
        try:
            yield
        finally:
            freezer.cancel()
            engine.stop()
            # waiting on a thread, not MLX work; it flushes queued KV writes first
            await asyncio.to_thread(engine.join, ENGINE_JOIN_S)
            if engine.is_alive():
                log.warning(
                    "the engine thread is still busy %.0f s after the stop (a model load "
                    "or a long step): leaving it",
                    ENGINE_JOIN_S,
                )
                app.state.engine_left_busy = True
            await asyncio.to_thread(state.obs.shutdown)  # flushes the last spans

    app = FastAPI(title="kvwarm", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(chat_router)
    app.include_router(messages_router)
    app.include_router(responses_router)
    app.include_router(completions_router)
    app.include_router(conv_kv_router)
    app.include_router(adapters_router)
    app.include_router(fit_router)
    app.include_router(models_router)
    _add_admin_routes(app)
    install_openapi(
        app,
        settings,
        [
            ChatCompletionRequest,
            CompletionRequest,
            MessagesRequest,
            CountTokensRequest,
            ResponsesRequest,
            ConvSaveRequest,
            ConvLoadRequest,
            AdapterMountRequest,
        ],
        lambda: _context_length(app),
    )
    # outermost last: unknown hosts are refused before anything else runs, CORS
    # preflights are answered before the key is asked for, and the key before a
    # body is measured (a stranger's body is neither budgeted nor counted)
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_size,
        max_in_flight=max(int(settings.max_bodies_bytes), settings.max_body_size),
        idle_timeout=settings.body_timeout,
    )
    app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(
        CrossOriginGuard,
        allowed=settings.cors_allowlist,
        # with a key a rebound page cannot call it anyway: its own /docs page may
        own_hosts_checked="*" not in settings.host_allowlist or bool(settings.api_key),
    )
    if settings.cors_allowlist:
        app.add_middleware(
            PreflightCORS,
            allow_origins=settings.cors_allowlist,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=[
                "Retry-After",
                "X-Kvwarm-Ignored-Fields",
                "request-id",
                "x-request-id",
            ],
        )
    app.add_middleware(HostCheckMiddleware, allowed_hosts=settings.host_allowlist)
    app.state.http_requests = RequestCounter()  # what a drain waits for (app.lifecycle)
    app.add_middleware(OpenRequests, counter=app.state.http_requests)
    app.add_middleware(RequestIdHeader)  # outermost: every response, each refusal too
    return app


async def _freeze_startup_objects(engine: StartableEngine) -> None:
    """Once the model is loaded, move every object alive (modules, model, tokenizer)
    out of the cyclic collector's sight: a full collection walking them paused the
    event loop for ~50 ms every few requests; afterwards it walks only new objects."""
    while engine.alive and not engine.ready:
        await asyncio.sleep(0.2)
    gc.freeze()


def _context_length(app: FastAPI) -> int | None:
    state = getattr(app.state, "kvwarm", None)
    info = state.engine.model_info if state is not None else None
    return info.context_length if info is not None else None


def _status(state: AppState, running_s: float | None = None) -> str:
    """ok / loading / stalled / draining / error: what /health answers and /stats
    says; ``running_s``: the step in progress's time, as read once by the caller
    (None: read it here)."""
    engine = state.engine
    if not engine.alive:
        return "error"
    if not engine.ready:
        return "loading"
    if state.stalled(state.step_running_s() if running_s is None else running_s):
        # a step that does not return (a GPU hang, swap thrash) is no healthy engine:
        # the thread is alive, but nothing it holds moves until the step ends
        return "stalled"
    return "draining" if state.service.scheduler.draining else "ok"


def _add_admin_routes(app: FastAPI) -> None:
    health_responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "Ready.", "content": json_content(HEALTH)},
        503: {
            "description": "Loading, draining for shutdown, a step running past "
            "--stall-timeout (stalled), or the engine died.",
            "content": json_content(HEALTH),
            "headers": RETRY_AFTER,
        },
    }
    metrics_responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "Prometheus exposition.", "content": {"text/plain": {}}}
    }

    @app.get("/health", responses=health_responses)
    async def health(request: Request) -> JSONResponse:
        state: AppState = request.app.state.kvwarm
        running_s = state.step_running_s()
        status = _status(state, running_s)
        if status == "error":
            # /health needs no key: behind one, why the engine died (paths, exception
            # text) is for /stats and the log, which do
            failure = state.engine.failure
            if state.settings.api_key:
                failure = "the inference engine stopped; /stats and the server log say why"
            return JSONResponse({"status": status, "error": failure}, 503)
        if status == "stalled":
            stalled = {"status": status, "step_running_s": round(running_s or 0.0, 3)}
            return JSONResponse(stalled, 503, headers=RETRY_LATER)
        if status != "ok":
            return JSONResponse({"status": status}, 503, headers=RETRY_LATER)
        return JSONResponse({"status": status})

    @app.get("/metrics", response_class=Response, responses=metrics_responses)
    async def metrics(request: Request) -> Response:
        state: AppState = request.app.state.kvwarm
        info = state.engine.model_info
        if info is not None:
            state.obs.metrics.ensure_model(info.model_id)
        return Response(state.obs.metrics.render(), media_type=CONTENT_TYPE)

    # load balancers and uptime monitors probe with HEAD (it was a 405): the GET's
    # status and headers, no body (the server drops it)
    for path, endpoint, documented in (
        ("/health", health, health_responses),
        ("/metrics", metrics, metrics_responses),
    ):
        app.add_api_route(
            path,
            endpoint,
            methods=["HEAD"],
            response_class=Response,
            operation_id=f"{endpoint.__name__}_head",
            responses={
                status: {k: v for k, v in doc.items() if k != "content"}
                for status, doc in documented.items()
            },
        )

    @app.get("/stats")
    async def stats(request: Request) -> dict[str, Any]:
        state: AppState = request.app.state.kvwarm
        engine = state.engine
        info = engine.model_info
        sched = state.service.scheduler.stats()
        eng = engine.engine_stats()
        budget = info.budget if info else None
        running_s = state.step_running_s()
        return {
            "status": _status(state, running_s),
            "model": info.model_id if info else None,
            "model_path": info.path if info else None,
            "device": info.device if info else None,
            "blas": info.blas if info else None,
            "context_length": info.context_length if info else None,
            "admission": {
                "budget_bytes": budget.total_bytes if budget else None,
                "budget_source": budget.source if budget else None,
                "weights_bytes": budget.weights_bytes if budget else None,
                "adapter_bytes": budget.adapter_bytes if budget else None,
                "adapters": [a.id for a in engine.adapters()],
                "reserve_bytes": budget.reserve_bytes if budget else None,
                "kv_budget_bytes": budget.kv_budget_bytes if budget else None,
                "kv_bytes_per_token": budget.kv_bytes_per_token if budget else None,
                "ceiling_tokens": budget.ceiling_tokens if budget else None,
                "reserved_kv_bytes": sched.reserved_kv_bytes,
            },
            "batch": {
                "configured": sched.max_running,
                "active_rows": eng.active_rows,
                "running_requests": sched.running,
            },
            "queue": {"depth": sched.waiting, "max": sched.max_queue},
            "requests": {
                "admitted": sched.admitted_total,
                "finished": sched.finished_total,
                "aborted": sched.aborted_total,
                "rejected": sched.rejected_total,
                "watchdog": sched.watchdog_aborts_total,
                "failed": sched.failed_total,
            },
            "engine": {
                "alive": engine.alive,
                "failure": engine.failure,
                "steps": eng.steps,
                # the step (or control job) in progress, None when idle: past
                # --stall-timeout, status is "stalled"
                "step_running_s": None if running_s is None else round(running_s, 3),
                "prefill_tokens": eng.prefill_tokens,
                "generated_tokens": eng.generated_tokens,
                "row_faults": eng.row_faults,
                "batch_recoveries": eng.recoveries,
                "step_budget": eng.steps_report.as_dict() if eng.steps_report else None,
            },
            "prompt_cache": eng.prompt_cache.as_dict() if eng.prompt_cache else None,
            "vision": asdict(eng.vision) if eng.vision else None,
            "healing": {"entries": len(state.healing), "healed": state.healing.healed},
        }
