"""What the routes reach through ``app.state.kvwarm``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.errors import APIError
from app.response_store import ResponseStore
from app.settings import Settings
from scheduler.contracts import EngineHandle, ModelInfo
from scheduler.healing import HealingStore
from scheduler.service import GenerationService


@dataclass
class AppState:
    settings: Settings
    engine: EngineHandle
    service: GenerationService
    healing: HealingStore = field(default_factory=HealingStore)
    responses: ResponseStore = field(default_factory=ResponseStore)
    started_at: float = field(default_factory=time.time)

    def model_info(self) -> ModelInfo:
        """The loaded model, or a 503 while it loads / after the engine died."""
        self.service.check_available()
        info = self.engine.model_info
        if info is None:  # pragma: no cover - ready implies info
            raise APIError(503, "The model is still loading.", "server_error", "loading")
        return info
