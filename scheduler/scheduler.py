"""FIFO waiting queue + running set, shared by HTTP handlers and the engine thread.

Handlers call ``add`` / ``abort``; the engine thread calls ``schedule`` once per
step and ``finish`` when a sequence leaves the batch. One lock guards the state;
nothing here blocks on the model.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from scheduler.admission import AdmissionController, AdmissionError, EngineUnavailable, QueueFull
from scheduler.contracts import StepPlan
from scheduler.request import Request, RequestState


@dataclass(frozen=True)
class SchedulerStats:
    waiting: int
    running: int
    max_running: int
    max_queue: int
    reserved_kv_bytes: int
    admitted_total: int
    finished_total: int
    aborted_total: int
    rejected_total: int
    watchdog_aborts_total: int = 0
    # ended by the engine: a start that raised, or dropped when the engine died
    failed_total: int = 0


class Scheduler:
    """Batch policy: at most ``max_running`` sequences decode together (1 = serial),
    admitted strictly in arrival order while the memory bound allows."""

    def __init__(
        self,
        admission: AdmissionController | None,
        max_running: int,
        max_queue: int,
        request_timeout_s: float | None = None,
        max_image_bytes: int | None = None,
    ):
        if max_running < 1:
            raise ValueError("max_running must be >= 1")
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.admission = admission
        self.max_running = max_running
        self.max_queue = max_queue
        # processed image inputs queued and running requests may hold at once: made
        # before a request queues, they are host memory no KV budget counts
        self.max_image_bytes = max_image_bytes
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting: deque[Request] = deque()
        self._running: dict[str, Request] = {}
        self._pending_aborts: set[str] = set()
        self._admitted = self._finished = self._aborted = self._rejected = 0
        self.request_timeout_s = request_timeout_s or None
        self._watchdog_aborts = 0
        self._failed = 0
        self._closed: str | None = None  # set once the engine is gone for good
        self._closed_by_shutdown = False  # ...by a shutdown, not a failure
        self._draining = False  # shutting down: finish what runs, admit nothing new
        self._shutdown_pending = False  # end everything at the next step

    # -- handler side -------------------------------------------------------
    def check_room(self) -> None:
        """Raise what ``add`` would for any request now (loading, closed, draining,
        a full queue): a route asks before preparing one, so a retry storm against
        a full queue is refused at once, not after a render and tokenisation each."""
        if self.admission is None:
            raise EngineUnavailable.loading()
        with self._lock:
            self._check_open_and_room()

    def _check_open_and_room(self) -> None:
        if self._closed is not None:
            if self._closed_by_shutdown:  # a restart is coming: worth a retry
                raise EngineUnavailable.shutting_down()
            raise EngineUnavailable(f"The inference engine is not running: {self._closed}")
        if self._draining:
            raise EngineUnavailable.shutting_down()
        if len(self._waiting) >= self.max_queue:
            self._rejected += 1
            raise QueueFull(
                f"The server is busy: {len(self._waiting)} requests are already "
                f"waiting (--max-queue {self.max_queue}). Retry later.",
                retry_after=1 + len(self._waiting) // self.max_running,
            )

    def add(self, request: Request) -> None:
        """Queue a request or raise an AdmissionError (400 / 429 / 503)."""
        if self.admission is None:
            raise EngineUnavailable.loading()
        try:
            self.admission.check_ever_fits(len(request.prompt_tokens), request.max_tokens)
        except Exception:
            with self._lock:
                self._rejected += 1
            raise
        with self._lock:
            self._check_open_and_room()
            self._check_image_bytes(request)
            request.state = RequestState.WAITING
            self._waiting.append(request)
        self._wake.set()

    def _check_image_bytes(self, request: Request) -> None:
        """Under the lock: refuse what would hold more image inputs than allowed."""
        cap, mine = self.max_image_bytes, request.image_bytes
        if cap is None or not mine:
            return
        if mine > cap:
            self._rejected += 1
            raise AdmissionError(
                f"This request's images make {mine / 2**20:.0f} MiB of model inputs; the "
                f"server holds at most {cap / 2**20:.0f} MiB (--max-image-inputs-bytes). "
                "Send fewer or smaller images."
            )
        held = sum(r.image_bytes for r in (*self._waiting, *self._running.values()))
        if held + mine > cap:
            self._rejected += 1
            raise QueueFull(
                f"The server is busy: queued and running requests hold "
                f"{held / 2**20:.0f} MiB of image inputs, this one needs {mine / 2**20:.0f} "
                f"MiB more (--max-image-inputs-bytes {cap / 2**20:.0f} MiB). Retry later.",
                retry_after=1 + len(self._waiting) // self.max_running,
            )

    def abort(self, request_id: str) -> None:
        """Cancel a request; a running one leaves the batch at the next step."""
        with self._lock:
            for req in self._waiting:
                if req.request_id == request_id:
                    self._waiting.remove(req)
                    req.state = RequestState.ABORTED
                    self._aborted += 1
                    return
            if request_id in self._running:
                self._pending_aborts.add(request_id)
        self._wake.set()

    def expire(self, request_id: str) -> RequestState | None:
        """The watchdog, from the handler side: a request past its deadline while the
        engine was busy in one step (its own watchdog runs between steps only) leaves
        as that watchdog takes it, counted once; a running one's row is dropped at
        the engine's next step, as for a client gone. Where it was (WAITING or
        RUNNING); None: it had left already, and the engine has its end in hand."""
        with self._lock:
            req = next((r for r in self._waiting if r.request_id == request_id), None)
            if req is not None:
                self._waiting.remove(req)
                where = RequestState.WAITING
            else:
                req = self._running.pop(request_id, None)
                if req is None:
                    return None
                self._pending_aborts.add(request_id)  # removed from the batch, uncounted
                where = RequestState.RUNNING
            req.state = RequestState.ABORTED
            self._watchdog_aborts += 1
            self._aborted += 1
        self._wake.set()
        return where

    # -- engine side --------------------------------------------------------
    def drain(self) -> None:
        """Stop admitting: new requests are refused, queued and running ones go on."""
        with self._lock:
            self._draining = True
        self._wake.set()

    @property
    def draining(self) -> bool:
        return self._draining

    def end_all(self) -> None:
        """At the next step, end every queued and running request (shutdown deadline)."""
        with self._lock:
            self._draining = True
            self._shutdown_pending = True
        self._wake.set()

    def in_flight(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._running)

    def reservations(self) -> tuple[list[int], list[int]]:
        """KV positions reserved by the running requests, and by the waiting ones."""
        with self._lock:
            return (
                [r.reserved_tokens for r in self._running.values()],
                [r.reserved_tokens for r in self._waiting],
            )

    def adapter_users(self, adapter_id: str) -> int:
        """Queued and running requests that use ``adapter_id``."""
        with self._lock:
            requests = [*self._waiting, *self._running.values()]
        return sum(1 for r in requests if r.adapter == adapter_id)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        with self._lock:
            if self._shutdown_pending:
                self._shutdown_pending = False
                running, waiting = self._drop_all()
                plan.shutdown = [r.request_id for r in [*running, *waiting]]
                self._aborted += len(plan.shutdown)
                return plan
            plan.expired, plan.timed_out = self._expire(time.monotonic())
            plan.abort = sorted(self._pending_aborts)
            self._pending_aborts.clear()
            for request_id in plan.abort:
                req = self._running.pop(request_id, None)
                if req is not None:
                    req.state = RequestState.ABORTED
                    self._aborted += 1
            reserved = [r.reserved_tokens for r in self._running.values()]
            admission = self.admission
            while admission and self._waiting and len(self._running) < self.max_running:
                head = self._waiting[0]
                if not admission.fits_with([], head.reserved_tokens):
                    self._waiting.popleft()  # it would wait for memory that never frees
                    head.state = RequestState.ABORTED
                    self._rejected += 1
                    plan.over_budget.append((head.request_id, self._never_fits(head)))
                    continue
                if not admission.fits_with(reserved, head.reserved_tokens):
                    break  # FIFO: the head waits for memory; nobody overtakes it
                self._waiting.popleft()
                head.state = RequestState.RUNNING
                self._running[head.request_id] = head
                reserved.append(head.reserved_tokens)
                plan.admit.append(head)
                self._admitted += 1
        return plan

    def _never_fits(self, request: Request) -> str:
        """Why a queued request can no longer run: the door's own words."""
        assert self.admission is not None
        try:
            self.admission.check_ever_fits(len(request.prompt_tokens), request.max_tokens)
        except AdmissionError as exc:
            return exc.message
        return (
            f"Request needs {request.reserved_tokens} KV positions, more than the memory "
            "budget now admits for one request. Lower max_tokens or shorten the prompt."
        )

    def _expire(self, now: float) -> tuple[list[str], list[str]]:
        """The watchdog: requests older than the timeout end, (waiting, running)."""
        if self.request_timeout_s is None:
            return [], []
        limit = now - self.request_timeout_s
        waiting = [r for r in self._waiting if r.arrival_time < limit]
        running = [r for r in self._running.values() if r.arrival_time < limit]
        if waiting:
            late = {id(r) for r in waiting}
            self._waiting = deque(r for r in self._waiting if id(r) not in late)
        for req in running:
            self._running.pop(req.request_id, None)
            self._pending_aborts.discard(req.request_id)
        for req in (*waiting, *running):
            req.state = RequestState.ABORTED
        self._watchdog_aborts += len(waiting) + len(running)
        self._aborted += len(waiting) + len(running)
        return [r.request_id for r in waiting], [r.request_id for r in running]

    def finish(self, request_id: str) -> None:
        with self._lock:
            if self._leave(request_id, RequestState.FINISHED):
                self._finished += 1

    def fail(self, request_id: str) -> None:
        """A running request the engine could not start or finish: it leaves as failed."""
        with self._lock:
            if self._leave(request_id, RequestState.ABORTED):
                self._failed += 1

    def _leave(self, request_id: str, state: RequestState) -> bool:
        """A running request leaves the batch in ``state``; False if it had left
        (lock held)."""
        req = self._running.pop(request_id, None)
        self._pending_aborts.discard(request_id)
        if req is not None:
            req.state = state
        return req is not None

    def fail_all(self, reason: str, shutdown: bool = False) -> tuple[list[Request], list[Request]]:
        """Drop every waiting and running request and refuse new ones: failed when
        the engine died, aborted when the server shuts down. (running, waiting):
        one that never started is no failure of its own, worth trying again."""
        with self._lock:
            self._closed = reason
            self._closed_by_shutdown = shutdown
            running, waiting = self._drop_all()
            if shutdown:
                self._aborted += len(running) + len(waiting)
            else:
                self._failed += len(running) + len(waiting)
            return running, waiting

    def _drop_all(self) -> tuple[list[Request], list[Request]]:
        """Every running and waiting request, taken out and marked aborted (lock held)."""
        running, waiting = list(self._running.values()), list(self._waiting)
        self._running.clear()
        self._waiting.clear()
        self._pending_aborts.clear()
        for req in [*running, *waiting]:
            req.state = RequestState.ABORTED
        return running, waiting

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running or self._pending_aborts)

    def wait_for_work(self, timeout: float) -> None:
        """Block the engine thread until a handler adds or aborts something."""
        if self._wake.wait(timeout):
            self._wake.clear()

    def wake(self) -> None:
        self._wake.set()

    def stats(self) -> SchedulerStats:
        with self._lock:
            return SchedulerStats(
                waiting=len(self._waiting),
                running=len(self._running),
                max_running=self.max_running,
                max_queue=self.max_queue,
                reserved_kv_bytes=self.admission.footprint(
                    r.reserved_tokens for r in self._running.values()
                )
                if self.admission
                else 0,
                admitted_total=self._admitted,
                finished_total=self._finished,
                aborted_total=self._aborted,
                rejected_total=self._rejected,
                watchdog_aborts_total=self._watchdog_aborts,
                failed_total=self._failed,
            )
