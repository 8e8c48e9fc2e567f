"""The one entry point HTTP handlers use: submit a Request, iterate its outputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from scheduler.admission import EngineUnavailable
from scheduler.contracts import EngineHandle
from scheduler.request import Request, RequestOutput
from scheduler.scheduler import Scheduler
from scheduler.streams import OutputRouter


class GenerationService:
    def __init__(self, scheduler: Scheduler, router: OutputRouter, engine: EngineHandle):
        self.scheduler = scheduler
        self.router = router
        self.engine = engine

    def check_available(self) -> None:
        if not self.engine.alive:
            raise EngineUnavailable(
                f"The inference engine is not running: {self.engine.failure or 'stopped'}"
            )
        if not self.engine.ready:
            raise EngineUnavailable.loading()
        if self.scheduler.draining:
            raise EngineUnavailable.shutting_down()

    def submit(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Admit ``request`` now (raising AdmissionError at once) and return its stream.

        Closing the stream early (client disconnect) aborts the request, which
        frees its batch slot at the engine's next step.
        """
        self.check_available()
        queue = self.router.open(request.request_id)
        try:
            self.scheduler.add(request)
        except BaseException:
            self.router.close(request.request_id)
            raise
        return self._stream(request.request_id, queue)

    def cancel(self, request_id: str) -> None:
        """Abort a request whose reader is gone (idempotent)."""
        self.router.close(request_id)
        self.scheduler.abort(request_id)

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[RequestOutput]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            self.router.close(request_id)
            if not finished:
                self.scheduler.abort(request_id)
