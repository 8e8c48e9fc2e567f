"""The one entry point HTTP handlers use: submit a Request, iterate its outputs."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

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
            if self.engine.failure is None:  # stopped by a shutdown: a restart is coming
                raise EngineUnavailable.shutting_down()
            raise EngineUnavailable(f"The inference engine is not running: {self.engine.failure}")
        if not self.engine.ready:
            raise EngineUnavailable.loading()
        if self.scheduler.draining:
            raise EngineUnavailable.shutting_down()

    def submit(self, request: Request) -> OutputStream:
        """Admit ``request`` now (raising AdmissionError at once) and return its stream.

        Closing the stream early (client disconnect), or dropping it unread,
        aborts the request, which frees its batch slot at the engine's next step.
        """
        self.check_available()
        queue = self.router.open(request.request_id)
        try:
            self.scheduler.add(request)
        except BaseException:
            self.router.close(request.request_id)
            raise
        return OutputStream(self, request.request_id, queue)

    def cancel(self, request_id: str) -> None:
        """Abort a request whose reader is gone (idempotent)."""
        self.router.close(request_id)
        self.scheduler.abort(request_id)


class OutputStream:
    """One request's outputs, read on the event loop until the finished one.

    Its reader may go without closing it: an async generator never started ran no
    ``finally`` (a handler that raised between submitting and reading left the
    request generating for nobody and its queue open), so a finalizer cancels a
    request not yet finished when the stream is collected, on the loop's thread.
    """

    def __init__(
        self, service: GenerationService, request_id: str, queue: asyncio.Queue[RequestOutput]
    ):
        self.request_id = request_id
        self._queue = queue
        self._service = service
        loop = asyncio.get_running_loop()
        self._cancel = weakref.finalize(self, call_soon_on, loop, service.cancel, request_id)
        self._cancel.atexit = False  # at exit the loop is gone: nothing to free

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._cancel.alive:  # closed, or finished
            raise StopAsyncIteration
        output = await self._queue.get()
        if output.finished:
            self._cancel.detach()
            self._service.router.close(self.request_id)
        return output

    async def aclose(self) -> None:
        if self._cancel.detach() is not None:  # once: a finished request is not aborted
            self._service.cancel(self.request_id)


def call_soon_on(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: Any) -> None:
    """``fn(*args)``, later, on ``loop``'s thread, for a finalizer: a collection runs
    on any thread and at any allocation, the loop's own included, possibly while it
    holds the scheduler's lock (cancelling inline there would wait on it for ever)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed (the server exited): nothing left to free
        pass
