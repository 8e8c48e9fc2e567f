"""What the routes reach through ``app.state.kvwarm``."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from app.body import Preparer
from app.errors import APIError
from app.response_store import ResponseStore
from app.settings import Settings
from kvcache.healing import HealingStore
from observability.hub import Observability
from observability.records import ServerSnapshot
from scheduler.admission import RETRY_AFTER_S, EngineUnavailable
from scheduler.contracts import EngineHandle, ModelInfo
from scheduler.service import GenerationService


@dataclass
class AppState:
    settings: Settings
    engine: EngineHandle
    service: GenerationService
    healing: HealingStore = field(default_factory=HealingStore)
    responses: ResponseStore = field(default_factory=ResponseStore)
    preparer: Preparer = field(default_factory=Preparer)  # request preparation, off the loop
    # the lifespan installs the configured hub; this default exports nothing
    obs: Observability = field(default_factory=lambda: Observability(env={}))
    started_at: float = field(default_factory=time.time)
    # adapter ids mounted at some point: a ``model`` naming one unmounted since is
    # a 404, not the base model's answer under the adapter's name
    adapters_seen: set[str] = field(default_factory=set)
    # held across an adapter's file read and its mount: one file in memory at a time
    # (each POST's limit is its own; 16 at once read 16 copies)
    adapter_mounts: asyncio.Lock = field(default_factory=asyncio.Lock)

    def snapshot(self) -> ServerSnapshot | None:
        """What /metrics reads at scrape time; None until the model is loaded."""
        info = self.engine.model_info
        if info is None:
            return None
        sched = self.service.scheduler.stats()
        return ServerSnapshot(
            model=info.model_id,
            running=sched.running,
            waiting=sched.waiting,
            reserved_kv_bytes=sched.reserved_kv_bytes,
            kv_budget_bytes=info.budget.kv_budget_bytes,
            watchdog_aborts=sched.watchdog_aborts_total,
            engine=self.engine.engine_stats(),
        )

    def step_running_s(self) -> float | None:
        """How long the engine's step (or control job) in progress has run; None: idle."""
        since = self.engine.busy_since
        return None if since is None else max(0.0, time.monotonic() - since)

    def stalled(self, running_s: float | None) -> bool:
        """A step has run past --stall-timeout (0: never counted as stalled)."""
        limit = self.settings.stall_timeout
        return bool(limit) and running_s is not None and running_s > limit

    def check_not_stalled(self) -> None:
        """A 503 (engine_stalled) while a step has run past --stall-timeout: a request
        queued behind it would wait on keep-alives for as long, where a client or a
        load balancer told at once goes elsewhere."""
        running_s = self.step_running_s()
        if self.stalled(running_s):
            raise EngineUnavailable(
                f"The inference engine has been busy in one step for {running_s:.0f} s "
                f"(--stall-timeout {self.settings.stall_timeout:g} s); retry later.",
                RETRY_AFTER_S,
                "engine_stalled",
            )

    def adapter(self, adapter_id: str | None, model: object = None) -> str | None:
        """A request's adapter: None (the base model) or a mounted one; else a 400.
        Without an ``adapter`` field, a ``model`` naming a mounted adapter selects it
        (as vLLM serves LoRA modules under their own model names)."""
        mounted = [a.id for a in self.engine.adapters()]
        self.adapters_seen.update(mounted)
        if adapter_id is None:
            if not isinstance(model, str) or model in mounted:
                return model if isinstance(model, str) else None
            if model in self.adapters_seen or model in dict(self.settings.adapters):
                raise APIError(
                    404,
                    f"The model {model!r} is an adapter that is not mounted now; mount it "
                    "again (POST /v1/adapters) or name the base model.",
                    param="model",
                    code="model_not_found",
                )
            return None
        if adapter_id not in mounted:
            shown = ", ".join(mounted[:16]) or "none"
            raise APIError(
                400,
                f"Unknown adapter {adapter_id!r}; mounted adapters: {shown}.",
                param="adapter",
                code="adapter_not_found",
            )
        return adapter_id

    def model_info(self) -> ModelInfo:
        """The loaded model, or a 503 while it loads / after the engine died."""
        self.service.check_available()
        self.check_not_stalled()
        info = self.engine.model_info
        if info is None:  # pragma: no cover - ready implies info
            raise EngineUnavailable.loading()
        self.obs.metrics.ensure_model(info.model_id)
        return info
