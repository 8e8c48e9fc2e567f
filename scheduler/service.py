"""The one entry point HTTP handlers use: submit a Request, iterate its outputs."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

from scheduler.admission import EngineUnavailable
from scheduler.contracts import EngineHandle
from scheduler.request import FinishReason, Request, RequestOutput, RequestState
from scheduler.scheduler import Scheduler
from scheduler.streams import OutputRouter

log = logging.getLogger("kvwarm.scheduler")
# past its --request-timeout deadline, a stream waits this much longer for the
# engine's own watchdog (it runs between steps: within a step of the deadline)
# before ending the request itself: only an engine stuck in a step is that late
DEADLINE_GRACE_S = 5.0
# put in a stream's queue when its deadline (and grace) passed: never published
_DEADLINE = RequestOutput("")


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
        timeout = self.scheduler.request_timeout_s
        deadline = None if timeout is None else request.arrival_time + timeout + DEADLINE_GRACE_S
        return OutputStream(self, request.request_id, queue, deadline)

    def cancel(self, request_id: str) -> None:
        """Abort a request whose reader is gone (idempotent)."""
        self.router.close(request_id)
        self.scheduler.abort(request_id)

    def expire(self, request_id: str, generated: bool) -> RequestOutput | None:
        """End a request past its deadline that the engine, stuck in a step, has not
        ended: as its watchdog would (a reply that ``generated`` tokens ends with
        finish length and them, one without gets 503 queue_timeout); the engine
        drops its row when the step returns. None: the engine is ending it."""
        where = self.scheduler.expire(request_id)
        if where is None:
            return None
        log.warning(
            "%s: past --request-timeout while the engine was busy in one step: ended here",
            request_id,
        )
        if where is RequestState.RUNNING and generated:
            return RequestOutput(request_id, finish_reason=FinishReason.LENGTH, timed_out=True)
        return RequestOutput.queue_timeout(request_id)


class OutputStream:
    """One request's outputs, read on the event loop until the finished one.

    Its reader may go without closing it: an async generator never started ran no
    ``finally`` (a handler that raised between submitting and reading left the
    request generating for nobody and its queue open), so a finalizer cancels a
    request not yet finished when the stream is collected, on the loop's thread.
    """

    def __init__(
        self,
        service: GenerationService,
        request_id: str,
        queue: asyncio.Queue[RequestOutput],
        deadline: float | None = None,
    ):
        self.request_id = request_id
        self._queue = queue
        self._service = service
        self._generated = False  # a token came: a watchdog end keeps the reply
        loop = asyncio.get_running_loop()
        # the deadline is enforced here too: the engine's watchdog runs between its
        # steps, and a step that never returns left every stream open for ever. The
        # timer holds the queue only, not this stream (whose finalizer must run).
        self._timer: asyncio.TimerHandle | None = None
        if deadline is not None:
            wait = max(0.0, deadline - time.monotonic())
            self._timer = loop.call_later(wait, queue.put_nowait, _DEADLINE)
        self._cancel = weakref.finalize(
            self, call_soon_on, loop, _abandon, service, request_id, self._timer
        )
        self._cancel.atexit = False  # at exit the loop is gone: nothing to free

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._cancel.alive:  # closed, or finished
            raise StopAsyncIteration
        output = await self._queue.get()
        if output is _DEADLINE:
            ended = self._service.expire(self.request_id, self._generated)
            output = ended if ended is not None else await self._queue.get()
        self._generated = self._generated or bool(output.token_ids or output.completion_tokens)
        if output.finished:
            self._cancel.detach()
            self._stop_timer()
            self._service.router.close(self.request_id)
        return output

    async def aclose(self) -> None:
        if self._cancel.detach() is not None:  # once: a finished request is not aborted
            self._stop_timer()
            self._service.cancel(self.request_id)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _abandon(
    service: GenerationService, request_id: str, timer: asyncio.TimerHandle | None
) -> None:
    """A stream collected unfinished: its request is aborted, its deadline let go."""
    if timer is not None:
        timer.cancel()
    service.cancel(request_id)


def call_soon_on(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: Any) -> None:
    """``fn(*args)``, later, on ``loop``'s thread, for a finalizer: a collection runs
    on any thread and at any allocation, the loop's own included, possibly while it
    holds the scheduler's lock (cancelling inline there would wait on it for ever)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed (the server exited): nothing left to free
        pass
