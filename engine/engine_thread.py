"""The engine thread: the only place MLX runs (model load included).

MLX streams are thread-local since 0.31, so the thread that loads the model
must run every prefill and decode. Handlers never call in here: they add to the
scheduler's queue and read per-request streams; this thread publishes each
step's outputs with one hop into the event loop.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from engine.adapter_files import (
    mount_peak_bytes,
    never_fits_bytes,
    read_adapter_files,
    tensor_cap,
)
from engine.distributed_config import DistributedConfig
from engine.model_errors import AdapterSettingError, LastingLoadError
from engine.model_source import ModelSource
from kvcache.index import PromptCacheConfig
from kvcache.interface import KVCacheDisabled, KVCacheManager
from kvcache.layout import KVQuant
from scheduler.admission import RETRY_AFTER_S, AdmissionController, EngineUnavailable
from scheduler.contracts import (
    AdapterError,
    AdapterExists,
    AdapterFiles,
    AdapterFormatError,
    AdapterInfo,
    AdapterInUse,
    AdapterNoRoomNow,
    AdapterNotFound,
    AdapterTooLarge,
    EngineStats,
    ModelInfo,
    Runner,
    StepPlan,
    VisionStats,
)
from scheduler.request import SHUTTING_DOWN, FinishReason, RequestOutput
from scheduler.scheduler import Scheduler
from scheduler.streams import OutputRouter

log = logging.getLogger("kvwarm.engine")
NOT_ON_A_GROUP = (
    "saving and loading conversations' KV is not available on a distributed group "
    "(each rank holds a shard of it)"
)
# after a lost rank, how long open streams get to see their error before the
# process exits (its engine thread may be stuck in a collective for good)
RANK_LOST_EXIT_S = 5.0
# control operations (saved-conversation loads, adapter mounts) run between two
# steps: while rows decode, a few per step (a flood of loads from one client
# stalled every stream's tokens), and a bounded queue of them (503 past it)
CONTROLS_PER_STEP = 4
MAX_PENDING_CONTROLS = 64
MEMORY_SAMPLE_S = 1.0
T = TypeVar("T")  # allocator readings for /metrics; a scrape needs no fresher


@dataclass(frozen=True)
class _NoRoom:
    """Why an adapter does not fit, and the error that says whether it ever will."""

    why: str
    error: type[AdapterError]


@dataclass(frozen=True)
class Booted:
    """What bringing an engine up yields: the runner the loop drives, the model
    as the HTTP layer sees it, and the admission rules for its memory."""

    runner: Runner
    info: ModelInfo
    admission: AdmissionController
    # allocator readings (active, peak, cache bytes) for /metrics; None: none to read
    memory: Callable[[], dict[str, int]] | None = None
    # a distributed group's rank monitor (engine.rank_health): calls back when a rank is lost
    ranks: Any = None
    group: Any = None  # engine.group_boot.GroupBoot on a distributed group


@dataclass(frozen=True)
class EngineConfig:
    source: ModelSource
    max_batch: int = 8
    prefill_step_size: int = 512
    max_step_ms: float | None = None  # None: auto, by backend (engine.boot); 0: token budget
    memory_budget_bytes: int | None = None  # None: auto
    blas: str = ""
    prompt_cache: PromptCacheConfig | None = None  # None: no prefix cache
    kv_dir: Path | None = None  # the prefix cache's SSD tier; None: RAM only
    kv_disk_bytes: int | None = None  # None: auto (a share of the free disk); 0: off
    kv_quant: KVQuant | None = None  # stored blocks quantized (--kv-bits)
    kv_tier: str = "ssd"  # kind of persistent tier (kvcache.tiers.PERSISTENT_TIERS)
    adapters: tuple[tuple[str, Path], ...] = ()  # --adapter ID=PATH: mounted at start
    # one model over several processes (engine.distributed); None: this process alone
    distributed: DistributedConfig | None = None
    group: Any = None  # the joined engine.distributed.RankGroup (set by the CLI)
    vision: str = "auto"  # --vision auto|on|off (engine.vision.wants_vision)
    image_pixels: tuple[int | None, int | None] = (None, None)  # --min/--max-pixels


class EngineThread(threading.Thread):
    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        router: OutputRouter,
        on_load_failure: Callable[[str, bool], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
        boot: Callable[[EngineConfig], Booted] | None = None,
    ):
        super().__init__(name="kvwarm-engine", daemon=True)
        # how the engine comes up: the real model (engine.boot) unless a test
        # hands in a model-free runner that runs under this same loop
        self._boot = boot
        self.config = config
        self.scheduler = scheduler
        self.router = router
        self._on_load_failure = on_load_failure
        self._on_fatal = on_fatal  # the engine died: the process should exit non-zero
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._failure: str | None = None
        self._model_info: ModelInfo | None = None
        self._runner: Runner | None = None
        self._steps = 0
        # requests whose start (runner.add) raised: failed alone, as the runner's own
        # row faults (counted here: a distributed runner's wrapper delegates reads only)
        self._start_faults = 0
        # when the step or control job in progress began (monotonic; None: idle):
        # written by this thread only, read lock-free by /health to see a hung step
        self._busy_since: float | None = None
        self._memory: dict[str, int] = {}
        self._memory_at = 0.0
        self._read_memory: Callable[[], dict[str, int]] | None = None
        # operations from HTTP routes (save/load a conversation, mount an adapter),
        # run on this thread between two steps
        self._controls: queue.SimpleQueue[tuple[Callable[[Runner], Any], Future[Any]]]
        self._controls = queue.SimpleQueue()
        self._fault: BaseException | None = None
        self._adapters: tuple[AdapterInfo, ...] = ()  # snapshot for the HTTP layer
        self._ranks: Any = None  # a distributed group's rank monitor (serving rank)
        # after a lost rank, exit this long after failing what was open (None: a
        # test's process stays up; the HTTP server's own exit still follows on_fatal)
        self.rank_lost_exit_s: float | None = RANK_LOST_EXIT_S

    # -- EngineHandle --------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.alive

    @property
    def alive(self) -> bool:
        return self._failure is None and not self._stopping.is_set()

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def model_info(self) -> ModelInfo | None:
        return self._model_info

    @property
    def busy_since(self) -> float | None:
        return self._busy_since

    def _progressed(self) -> None:
        """The step in progress moved on (a recovery's probes and replays): a long
        recovery of several rows is no hung step."""
        self._busy_since = time.monotonic()

    def engine_stats(self) -> EngineStats:
        runner = self._runner
        return EngineStats(
            steps=self._steps,
            active_rows=runner.active if runner else 0,
            prefill_tokens=runner.prefill_tokens if runner else 0,
            generated_tokens=runner.generated_tokens if runner else 0,
            prompt_cache=runner.prefix_cache.stats() if runner and runner.prefix_cache else None,
            batch_sizes=tuple(runner.batch_sizes) if runner else (),
            memory=dict(self._memory),
            row_faults=(runner.row_faults if runner else 0) + self._start_faults,
            recoveries=runner.recoveries if runner else 0,
            steps_report=runner.timings.snapshot() if runner else None,
            vision=_vision_stats(runner),
        )

    def kv(self, op: Callable[[KVCacheManager], T]) -> Future[T]:
        """Run ``op`` on the KV manager between two steps (the engine thread owns
        its arrays); the future fails with EngineUnavailable or KVCacheDisabled."""

        def on_cache(runner: Runner) -> T:
            if runner.prefix_cache is None:
                raise KVCacheDisabled()
            return op(runner.prefix_cache)

        runner = self._runner
        if self.ready and self.config.group is not None:
            future: Future[T] = Future()
            future.set_exception(KVCacheDisabled(NOT_ON_A_GROUP))
            return future
        if self.ready and runner is not None and runner.prefix_cache is None:
            future = Future()
            future.set_exception(KVCacheDisabled())
            return future
        return self.control(on_cache)

    def control(self, op: Callable[[Runner], T]) -> Future[T]:
        """Run ``op`` on the runner between two steps, never during a forward pass;
        the future fails with EngineUnavailable while the engine is not running."""
        future: Future[T] = Future()
        if not self.ready or self._runner is None:
            future.set_exception(
                EngineUnavailable.loading()
                if self.alive
                else EngineUnavailable(f"The inference engine is not running: {self._failure}")
            )
        elif self._controls.qsize() >= MAX_PENDING_CONTROLS:
            future.set_exception(
                EngineUnavailable(
                    f"The engine has {MAX_PENDING_CONTROLS} operations waiting; retry shortly.",
                    RETRY_AFTER_S,
                    "engine_busy",
                )
            )
        else:
            self._controls.put((op, future))
            self.scheduler.wake()
            if not self.alive:
                # it died or stopped after the check: its last drain may be over
                # already, and nobody else would ever answer this future
                self._fail_controls(self._failure or SHUTTING_DOWN)
        return future

    def adapters(self) -> tuple[AdapterInfo, ...]:
        return self._adapters

    def mount_adapter(
        self, adapter_id: str, files: AdapterFiles, scale: float = 1.0
    ) -> Future[AdapterInfo]:
        """Mount an adapter between two steps (its files were read off this thread:
        engine.adapter_files); admission then counts its bytes."""

        return self.control(
            lambda runner: self._mount_within_budget(runner, adapter_id, files, scale)
        )

    def _mount_within_budget(
        self, runner: Runner, adapter_id: str, files: AdapterFiles, scale: float = 1.0
    ) -> AdapterInfo:
        """Mount with the room asked first and again after (at start and at run time)."""
        self._refuse_base_id(adapter_id)
        # priced by its file before it is read: loading one past the budget first
        # could take the memory the budget keeps (on Metal, the process with it);
        # at its peak, the file's bytes and the arrays built from them
        peak = mount_peak_bytes(files.weights_size)
        problem = self._adapter_room(runner.adapter_bytes() + peak)
        if problem is not None:
            size = f"{peak / 2**20:.1f} MiB while it mounts"
            raise problem.error(f"adapter {adapter_id!r} ({size}) {problem.why}")
        info = runner.mount_adapter(adapter_id, files, scale)
        problem = self._adapter_room(runner.adapter_bytes())
        if problem is not None:
            runner.unmount_adapter(adapter_id)
            size = f"{info.size_bytes / 2**20:.1f} MiB"
            raise problem.error(f"adapter {adapter_id!r} ({size}) {problem.why}")
        self._recount_adapters(runner)
        return info

    def _refuse_base_id(self, adapter_id: str) -> None:
        """An adapter named as the base model would take every request naming it
        (as /v1/models lists it): at start and at run time alike."""
        info = self._model_info
        if info is not None and adapter_id == info.model_id:
            raise AdapterExists(
                f"{adapter_id!r} is the base model's id; mount the adapter under another"
            )

    def unmount_adapter(self, adapter_id: str) -> Future[AdapterInfo]:
        """Unmount between two steps; refused while queued or running requests use it."""

        def unmount(runner: Runner) -> AdapterInfo:
            users = self.scheduler.adapter_users(adapter_id)
            if users and any(a.id == adapter_id for a in runner.adapter_infos()):
                raise AdapterInUse(
                    f"adapter {adapter_id!r} is in use by {users} queued or running "
                    "request(s); unmount it when they finish"
                )
            info = runner.unmount_adapter(adapter_id)
            self._recount_adapters(runner)
            return info

        return self.control(unmount)

    def _adapter_room(self, adapter_bytes: int) -> _NoRoom | None:
        """Why the KV budget left beside ``adapter_bytes`` of adapters cannot hold
        what admission already promised (running and queued requests); None: it can."""
        admission = self.scheduler.admission
        if admission is None:
            return None
        budget = replace(admission.budget, adapter_bytes=adapter_bytes)
        if budget.ceiling_tokens <= 0:
            why = "leaves no KV budget for requests; unmount another or raise --memory-budget"
            return _NoRoom(why, AdapterTooLarge)
        running, waiting = self.scheduler.reservations()
        if AdmissionController(budget, admission.context_length).footprint(running) > (
            budget.kv_budget_bytes
        ):
            why = "does not fit beside the running requests' KV; retry when they finish"
            return _NoRoom(why, AdapterNoRoomNow)
        if any(r > budget.ceiling_tokens for r in waiting):
            why = (
                "would leave less KV per request than a queued request was admitted "
                f"with (ceiling {budget.ceiling_tokens} tokens); retry when the queue drains"
            )
            return _NoRoom(why, AdapterNoRoomNow)
        return None

    def _recount_adapters(self, runner: Runner) -> None:
        """Admission counts the mounted adapters' bytes as weights (after _adapter_room)."""
        self._adapters = tuple(runner.adapter_infos())
        admission = self.scheduler.admission
        info = self._model_info
        if admission is None or info is None:
            return
        budget = replace(admission.budget, adapter_bytes=runner.adapter_bytes())
        admission.budget = budget
        self._model_info = replace(info, budget=budget)

    def _run_controls(self, limit: int | None = None) -> None:
        """Pending control operations, at most ``limit`` (None: all)."""
        ran = 0
        while limit is None or ran < limit:
            ran += 1
            try:
                op, future = self._controls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            self._busy_since = time.monotonic()  # each job timed alone (a load may be long)
            try:
                future.set_result(op(self._runner))
            except Exception as exc:  # noqa: BLE001 - the caller's to report
                future.set_exception(exc)
            except BaseException as exc:
                # it ends the engine; the caller is answered first (running, this
                # future is out of the queue the engine's last drain answers), and
                # as a 503: a SystemExit set on it would stop the event loop
                future.set_exception(
                    EngineUnavailable(f"The inference engine stopped: {type(exc).__name__}: {exc}")
                )
                raise

    def _fail_controls(self, reason: str) -> None:
        while True:
            try:
                _, future = self._controls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineUnavailable(reason))

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.ready

    def stop(self) -> None:
        self._stopping.set()
        self.scheduler.wake()

    def inject_fault(self, exc: BaseException) -> None:
        """Make the step loop raise ``exc`` (tests of the engine-death path)."""
        self._fault = exc
        self.scheduler.wake()

    # -- thread body ---------------------------------------------------------
    def run(self) -> None:
        try:
            self._load()
        except Exception as exc:
            self._die(f"model load failed: {exc}", exc)
            # a failure after the boot (an --adapter) has a runner and ranks: its disk
            # tier is flushed and its other ranks told to stop (as failed: _die), not
            # left to time out
            self._close_quietly()
            if self._on_load_failure is not None:  # lasting: the next start fails alike
                self._on_load_failure(self._failure or "", isinstance(exc, LastingLoadError))
            return
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - any escape kills the engine
            self._die(f"engine step failed: {type(exc).__name__}: {exc}", exc)
            if self._on_fatal is not None:
                self._on_fatal(self._failure or "")
        finally:
            # everyone waiting is answered first: closing may wait on a disk flush
            # (seconds) or raise on a device that just failed
            self._fail_controls(self._failure or SHUTTING_DOWN)
            if self._stopping.is_set():  # orderly shutdown: end every open stream
                self._fail_open_requests(SHUTTING_DOWN, "server_shutdown")
            self._close_quietly()
            self._fail_controls(self._failure or SHUTTING_DOWN)  # any sent meanwhile

    def _close_quietly(self) -> None:
        """Close the runner, then the rank group (after the runner told the other
        ranks to stop); a failure of either is logged, the other still runs."""
        for what, part in (("runner", self._runner), ("rank group", self._ranks)):
            if part is None:
                continue
            try:
                part.close()
            except Exception:  # noqa: BLE001 - the thread is ending either way
                log.exception("closing the engine's %s failed", what)

    def _load(self) -> None:
        if self._boot is None:
            from engine.boot import boot_mlx  # mlx: imported on this thread only

            self._boot = boot_mlx
        booted = self._boot(self.config)
        self.scheduler.admission = booted.admission
        self._runner = booted.runner
        booted.runner.progress = self._progressed
        self._model_info = booted.info
        self._read_memory = booted.memory
        self._ranks = booted.ranks
        if booted.ranks is not None:
            booted.ranks.start(self._rank_lost)
        # as a run-time mount: a size limit on the read, the room asked before the
        # mount (mounted first, one past the budget took the memory it keeps)
        limit = never_fits_bytes(booted.admission.budget)  # mounted adapters aside
        cap = tensor_cap(booted.info.adapter_layers)
        for adapter_id, path in self.config.adapters:
            where = f"--adapter {adapter_id}={path}"
            try:
                self._refuse_base_id(adapter_id)
            except Exception as exc:
                raise AdapterSettingError(f"{where}: {exc}") from exc
            try:
                files = read_adapter_files(path, limit, cap)
            except (AdapterTooLarge, AdapterFormatError) as exc:
                # the next start reads the same size and bytes: lasting (exit 2, or a
                # supervisor reloads the model for ever to refuse them again)
                raise AdapterSettingError(f"{where}: {exc}") from exc
            except Exception as exc:  # a mount not up yet, perhaps: the next start may read it
                raise RuntimeError(f"{where}: {exc}") from exc
            try:
                self._mount_within_budget(self._runner, adapter_id, files)
            except Exception as exc:  # not for this model, or no room for it
                raise AdapterSettingError(f"{where}: {exc}") from exc
        self._sample_memory()
        self._ready.set()

    def _loop(self) -> None:
        runner = self._runner
        scheduler = self.scheduler
        while not self._stopping.is_set():
            self._busy_since = time.monotonic()
            if self._fault is not None:
                raise self._fault
            self._run_controls(CONTROLS_PER_STEP if runner.active else None)
            if runner.prefix_cache is not None:
                runner.prefix_cache.poll()  # finished disk writes show in /stats promptly
            plan = scheduler.schedule()
            self.router.publish(self._apply_plan_exits(plan))
            failed = []
            started = []
            for request in plan.admit:
                try:
                    first = runner.add(request)
                    if first is not None:
                        started.append(first)
                except AdapterNotFound as exc:  # unmounted after the request was validated
                    # the client's 400, not an engine fault: no row fault counted
                    scheduler.fail(request.request_id)
                    failed.append(
                        RequestOutput.failure(request.request_id, str(exc), "adapter_not_found")
                    )
                except Exception as exc:  # one bad request must not take the engine down
                    log.exception("%s: could not start", request.request_id)
                    self._start_faults += 1
                    scheduler.fail(request.request_id)
                    failed.append(
                        RequestOutput.failure(request.request_id, f"{type(exc).__name__}: {exc}")
                    )
            self._leave(started)  # an add may answer with the request's end
            self.router.publish(started + failed)
            if runner.active == 0:
                self._sample_memory()  # idle gauges still move (freed cache, clear_cache)
                if not failed:  # a failed start freed a slot the queue's next may take now
                    self._busy_since = None
                    scheduler.wait_for_work(timeout=0.5)
                continue
            outputs = runner.step()
            if not runner.waited_on_reads:  # a wait on disk reads ran no model step
                self._steps += 1
            self._sample_memory()
            self._leave(outputs)
            self.router.publish(outputs)

    def _leave(self, outputs: list[RequestOutput]) -> None:
        """Requests these outputs end leave the scheduler, before their clients hear:
        an engine error as failed (/stats counted rows failed alone as finished)."""
        for output in outputs:
            if output.finish_reason is FinishReason.ERROR:
                self.scheduler.fail(output.request_id)
            elif output.finished:
                self.scheduler.finish(output.request_id)

    def _apply_plan_exits(self, plan: StepPlan) -> list[RequestOutput]:
        """Rows leaving the batch before this step, and the outputs that end them."""
        outputs: list[RequestOutput] = []
        try:
            self._exits(plan, outputs)
        except Exception:
            # the scheduler has let go of these already: the engine's death would
            # fail only what it still holds, and these would never hear an end
            ended = {o.request_id for o in outputs}
            leaving = [*plan.timed_out, *plan.expired, *plan.shutdown]
            leaving += [request_id for request_id, _ in plan.over_budget]
            self.router.publish(
                outputs
                + [
                    RequestOutput.failure(r, "the engine failed ending this request")
                    for r in leaving
                    if r not in ended
                ]
            )
            raise
        return outputs

    def _exits(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        runner = self._runner
        for request_id in plan.abort:
            runner.remove(request_id)
        for request_id in plan.timed_out:
            log.warning("%s: cut short by the watchdog (--request-timeout)", request_id)
            out = runner.cut_short(request_id)
            outputs.append(out or RequestOutput(request_id, finish_reason=FinishReason.LENGTH))
        for request_id in plan.expired:
            log.warning("%s: expired in the queue (--request-timeout)", request_id)
            outputs.append(RequestOutput.queue_timeout(request_id))
        for request_id in plan.shutdown:
            runner.remove(request_id)
            outputs.append(RequestOutput.shutdown(request_id))
        for request_id, why in plan.over_budget:
            log.warning("%s: refused in the queue: %s", request_id, why)
            outputs.append(RequestOutput.failure(request_id, why, "context_over_budget"))

    def _sample_memory(self) -> None:
        now = time.monotonic()
        if self._read_memory is not None and now - self._memory_at >= MEMORY_SAMPLE_S:
            self._memory = self._read_memory()
            self._memory_at = now

    def _rank_lost(self, reason: str) -> None:
        """A rank of the distributed group died or hangs (engine.rank_health, its
        thread): the engine cannot step any more. Fail everything open, turn
        /health 503 and exit non-zero so a supervisor restarts the whole group."""
        self._failure = f"a rank of the distributed group was lost: {reason}"
        log.error("%s; exiting", self._failure)
        runner = self._runner
        if runner is not None and hasattr(runner, "broken"):
            runner.broken = True  # no goodbye broadcast: it would wait for the lost rank
        self._fail_open_requests(self._failure)
        if self._on_fatal is not None:
            self._on_fatal(self._failure)
        if self.rank_lost_exit_s is not None:
            threading.Timer(self.rank_lost_exit_s, exit_now, args=(1,)).start()

    def _die(self, reason: str, exc: BaseException) -> None:
        if isinstance(exc, LastingLoadError):  # the model or the settings: the reason says it
            log.error("%s", reason)
            log.debug("%s: where it was raised", reason, exc_info=exc)
        else:
            log.error("%s", reason, exc_info=exc)
        self._failure = reason
        if self._runner is not None and hasattr(self._runner, "failure"):
            self._runner.failure = reason  # a group's other ranks stop as failed too
        self._fail_open_requests(reason)
        self._ready.set()  # unblock anyone waiting for readiness

    def _fail_open_requests(self, reason: str, code: str = "engine_error") -> None:
        """End every waiting and running request with ``reason``; refuse new ones.
        A request still waiting when the engine died did not fail itself: it gets
        what a request arriving a moment later gets (503, engine_unavailable)."""
        running, waiting = self.scheduler.fail_all(reason, shutdown=code == "server_shutdown")
        queued = "engine_unavailable" if code == "engine_error" else code
        self.router.publish(RequestOutput.failure(r.request_id, reason, code) for r in running)
        self.router.publish(RequestOutput.failure(r.request_id, reason, queued) for r in waiting)


def exit_now(code: int) -> None:
    """Leave without joining threads: one may be blocked in a collective for good."""
    try:
        logging.shutdown()  # from a signal handler it may interrupt a write, and raise
    finally:
        os._exit(code)


def _vision_stats(runner: Runner | None) -> VisionStats | None:
    vision = getattr(runner, "vision", None)  # engine.vision.VisionPrefill
    return VisionStats(**asdict(vision.counters)) if vision is not None else None
