from __future__ import annotations

import threading

import pytest

from kvcache.layout import GROWTH_SLACK
from scheduler.admission import (
    AdmissionController,
    EngineUnavailable,
    MemoryBudget,
    OverBudget,
    QueueFull,
)
from scheduler.request import Request, RequestState
from scheduler.scheduler import Scheduler


def make(max_running=2, max_queue=4, kv_tokens=10_000) -> Scheduler:
    budget = MemoryBudget(
        total_bytes=kv_tokens + 2, weights_bytes=1, reserve_bytes=1, kv_bytes_per_token=1
    )
    return Scheduler(AdmissionController(budget, 100_000), max_running, max_queue)


def req(name: str, prompt=10, max_tokens=10) -> Request:
    return Request(list(range(prompt)), max_tokens, request_id=name)


def test_fifo_up_to_batch_size():
    s = make(max_running=2)
    for n in "abc":
        s.add(req(n))
    plan = s.schedule()
    assert [r.request_id for r in plan.admit] == ["a", "b"]
    assert all(r.state is RequestState.RUNNING for r in plan.admit)
    assert s.schedule().admit == []  # batch full
    s.finish("a")
    assert [r.request_id for r in s.schedule().admit] == ["c"]
    st = s.stats()
    assert (st.running, st.waiting, st.finished_total) == (2, 0, 1)


def test_batch_one_serialises():
    s = make(max_running=1)
    s.add(req("a"))
    s.add(req("b"))
    assert [r.request_id for r in s.schedule().admit] == ["a"]
    assert s.schedule().admit == []
    s.finish("a")
    assert [r.request_id for r in s.schedule().admit] == ["b"]


def test_head_waits_for_memory_and_nobody_overtakes():
    s = make(max_running=8, kv_tokens=1024 + GROWTH_SLACK)
    s.add(req("big", prompt=500, max_tokens=500))  # 1024 + growth slack: the whole budget
    s.add(req("next", prompt=500, max_tokens=200))
    s.add(req("tiny", prompt=1, max_tokens=1))
    assert [r.request_id for r in s.schedule().admit] == ["big"]
    assert s.schedule().admit == []  # "tiny" would fit nowhere either: FIFO holds
    s.finish("big")
    # "tiny" joining "next" would be a 2 x (768 + slack) rectangle: over, it waits its turn
    assert [r.request_id for r in s.schedule().admit] == ["next"]
    s.finish("next")
    assert [r.request_id for r in s.schedule().admit] == ["tiny"]


def test_never_fitting_request_is_refused_at_once():
    s = make(kv_tokens=512)
    with pytest.raises(OverBudget):
        s.add(req("huge", prompt=300, max_tokens=300))
    assert s.stats().rejected_total == 1 and s.stats().waiting == 0


def test_a_queued_request_the_budget_shrinks_below_is_refused_not_waited_on():
    """The budget can shrink after a request was checked at the door (an adapter
    mounted meanwhile); a head that no longer fits even alone held the FIFO queue,
    and everyone behind it, forever."""
    s = make(max_running=4, kv_tokens=4096 + GROWTH_SLACK)
    s.add(req("big", prompt=3000, max_tokens=1000))
    s.add(req("small"))
    admission = s.admission
    assert admission is not None
    admission.budget = MemoryBudget(
        total_bytes=2050, weights_bytes=1, reserve_bytes=1, kv_bytes_per_token=1
    )
    plan = s.schedule()
    assert [r.request_id for r in plan.admit] == ["small"]
    ((rid, why),) = plan.over_budget
    assert rid == "big" and "memory budget" in why and plan
    st = s.stats()
    assert (st.waiting, st.running, st.rejected_total) == (0, 1, 1)
    assert s.schedule().over_budget == []


def test_queue_full_is_429_with_retry_after():
    s = make(max_running=1, max_queue=2)
    s.add(req("a"))
    s.add(req("b"))
    with pytest.raises(QueueFull) as exc:
        s.add(req("c"))
    assert exc.value.status == 429 and exc.value.retry_after >= 1


def test_abort_waiting_and_running():
    s = make(max_running=1)
    s.add(req("run"))
    s.add(req("wait"))
    s.schedule()
    s.abort("wait")
    s.abort("run")
    plan = s.schedule()
    assert plan.abort == ["run"] and plan.admit == []
    st = s.stats()
    assert (st.running, st.waiting, st.aborted_total) == (0, 0, 2)


def test_a_deadline_enforced_off_the_engine_is_counted_once_and_drops_the_row():
    """The stream ends a late request while the engine is stuck in a step: the
    scheduler lets it go as its watchdog would, and the row leaves at the next step
    as an abort, neither counted again nor ended again by the engine's watchdog."""
    s = make(max_running=1)
    s.request_timeout_s = 60.0
    s.add(req("run"))
    s.add(req("wait"))
    s.schedule()
    assert s.expire("run") is RequestState.RUNNING
    assert s.expire("wait") is RequestState.WAITING
    assert s.expire("run") is None  # left already: the engine ends it
    plan = s.schedule()  # the engine's next step, once the stuck one returned
    assert plan.abort == ["run"] and not plan.timed_out and not plan.expired
    st = s.stats()
    assert (st.running, st.waiting) == (0, 0)
    assert (st.watchdog_aborts_total, st.aborted_total, st.finished_total) == (2, 2, 0)


def test_abort_of_unknown_id_is_harmless():
    s = make()
    s.abort("ghost")
    assert not s.schedule()


def test_fail_all_drops_everything_and_refuses_new_work():
    s = make(max_running=1)
    s.add(req("a"))
    s.add(req("b"))
    s.schedule()
    running, waiting = s.fail_all("boom")
    assert [r.request_id for r in running] == ["a"] and [r.request_id for r in waiting] == ["b"]
    with pytest.raises(EngineUnavailable):
        s.add(req("c"))
    # counted: an engine's death left every counter as if they still ran
    st = s.stats()
    assert (st.failed_total, st.finished_total, st.aborted_total) == (2, 0, 0)


def test_requests_a_shutdown_ends_are_aborted_not_failed():
    s = make(max_running=1)
    s.add(req("a"))
    s.add(req("b"))
    s.schedule()
    s.fail_all("the server is shutting down", shutdown=True)
    st = s.stats()
    assert (st.failed_total, st.aborted_total) == (0, 2)


def test_a_request_the_engine_could_not_start_is_failed_not_finished():
    s = make()
    s.add(req("a"))
    (started,) = s.schedule().admit
    s.fail(started.request_id)
    st = s.stats()
    assert (st.running, st.failed_total, st.finished_total) == (0, 1, 0)
    assert started.state is RequestState.ABORTED


def test_a_request_the_engine_fails_mid_batch_is_failed_not_finished(monkeypatch):
    """A row failed alone by a step (its sampler raised, its cached KV could not be
    read, a recovery's probe) ended in an error but counted as finished in /stats;
    one the runner's add answers with an error is failed too, not left running."""
    import asyncio

    from scheduler.request import FinishReason, RequestOutput
    from scheduler.service import GenerationService
    from scheduler.streams import OutputRouter
    from tests.helpers.fake_engine import FakeEngine, FakeRunner

    step, add = FakeRunner.step, FakeRunner.add

    def failing_step(self):
        outputs = step(self)
        for i, out in enumerate(outputs):
            if out.request_id == "bad" and not out.finished:
                del self._active["bad"]
                outputs[i] = RequestOutput.failure("bad", "its sampler raised")
        return outputs

    def refusing_add(self, request):
        if request.request_id == "refused":
            return RequestOutput.failure("refused", "expired in the queue", "queue_timeout")
        return add(self, request)

    monkeypatch.setattr(FakeRunner, "step", failing_step)
    monkeypatch.setattr(FakeRunner, "add", refusing_add)

    async def main():
        router = OutputRouter(asyncio.get_running_loop())
        sched = Scheduler(None, max_running=3, max_queue=10)
        engine = FakeEngine(sched, router, step_delay=0.005)
        engine.start()
        engine.wait_ready(5)
        try:
            service = GenerationService(sched, router, engine)
            ends = {}
            for name in ("bad", "good", "refused"):
                async for out in service.submit(Request(list(range(10)), 3, request_id=name)):
                    ends[name] = out.finish_reason
            return ends, sched.stats()
        finally:
            engine.stop()
            engine.join(5)

    ends, st = asyncio.run(main())
    assert ends == {
        "bad": FinishReason.ERROR,
        "good": FinishReason.LENGTH,
        "refused": FinishReason.ERROR,
    }
    assert (st.running, st.failed_total, st.finished_total) == (0, 2, 1)


def test_loading_scheduler_refuses_with_503():
    s = Scheduler(None, 1, 1)
    with pytest.raises(EngineUnavailable):
        s.add(req("a"))


def test_wait_for_work_wakes_on_add():
    s = make()
    woke = threading.Event()

    def engine():
        s.wait_for_work(timeout=5)
        woke.set()

    t = threading.Thread(target=engine)
    t.start()
    s.add(req("a"))
    t.join(5)
    assert woke.is_set()


def test_concurrent_adds_never_exceed_the_queue():
    s = make(max_running=1, max_queue=50)
    errors = []

    def add_many(k):
        for i in range(40):
            try:
                s.add(req(f"{k}-{i}"))
            except QueueFull:
                errors.append(1)

    threads = [threading.Thread(target=add_many, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.stats().waiting == 50 and len(errors) == 160 - 50


def test_image_inputs_held_by_queued_and_running_requests_are_bounded():
    """The processor's arrays are made before a request queues and held until it
    ends, outside every KV budget: 64 queued requests of five 2048 px images held
    27 GiB. Beyond the cap a request is a 429 to retry, one over it alone a 400."""
    import numpy as np

    from scheduler.admission import AdmissionError
    from scheduler.request import ImageInput

    def with_images(name: str, mib: int) -> Request:
        pixels = np.zeros(mib * 2**20, dtype=np.uint8)
        image = ImageInput(1, (7, 7), b"k", b"k", inputs={"pixel_values": pixels})
        return Request(list(range(10)), 10, images=(image,), request_id=name)

    s = make(max_running=1)
    s.max_image_bytes = 100 * 2**20
    s.add(with_images("a", 60))
    s.schedule()  # a runs: its arrays are still held (a batch recovery re-reads them)
    s.add(req("text"))  # no images: never refused for them
    with pytest.raises(QueueFull) as busy:
        s.add(with_images("b", 60))
    assert busy.value.status == 429 and "--max-image-inputs-bytes" in busy.value.message
    with pytest.raises(AdmissionError) as never:
        s.add(with_images("huge", 101))
    assert never.value.status == 400
    s.finish("a")
    s.add(with_images("b", 60))  # a's arrays are gone
    assert s.stats().rejected_total == 2


@pytest.mark.parametrize("read_first", [False, True])
def test_a_stream_dropped_unread_aborts_its_request_and_closes_its_queue(read_first):
    """submit() returned an async generator whose finally aborted the request: one
    never started never ran it (a handler raising between submit and reading), so
    the request generated to its end for nobody and its queue stayed open (shutdown
    then waited its full drain time for it)."""
    import asyncio
    import gc

    from scheduler.service import GenerationService
    from scheduler.streams import OutputRouter
    from tests.helpers.fake_engine import FakeEngine

    async def main():
        router = OutputRouter(asyncio.get_running_loop())
        sched = Scheduler(None, max_running=2, max_queue=10)
        engine = FakeEngine(sched, router, step_delay=0.01)
        engine.start()
        engine.wait_ready(5)
        try:
            service = GenerationService(sched, router, engine)
            stream = service.submit(Request(list(range(10)), 500, ignore_eos=True))
            if read_first:
                await anext(stream)
            del stream
            gc.collect()
            for _ in range(100):
                await asyncio.sleep(0.02)
                if sched.stats().aborted_total:
                    break
            stats = sched.stats()
            return stats.aborted_total, stats.finished_total, len(router)
        finally:
            engine.stop()
            engine.join(5)

    assert asyncio.run(main()) == (1, 0, 0)


def test_a_collected_stream_cancels_later_on_the_loop_never_inline():
    """A collection runs at any allocation, on the loop's own thread too, perhaps
    while it holds the scheduler's lock: a cancel run inline there waited on that
    lock for ever (the whole server hung)."""
    import asyncio

    from scheduler.service import call_soon_on

    async def main():
        cancelled: list[str] = []
        call_soon_on(asyncio.get_running_loop(), cancelled.append, "r1")
        inline = list(cancelled)
        await asyncio.sleep(0)
        return inline, cancelled

    assert asyncio.run(main()) == ([], ["r1"])


@pytest.mark.parametrize(
    "shutdown, code", [(True, "server_shutdown"), (False, "engine_unavailable")]
)
def test_a_scheduler_closed_by_a_shutdown_refuses_as_one_worth_retrying(shutdown, code):
    """A request after a graceful shutdown's end was refused as if the engine had died
    (engine_unavailable, with no Retry-After), which now tells SDKs not to retry,
    though a supervisor's restart is coming."""
    s = make()
    s.fail_all("the server is shutting down" if shutdown else "boom", shutdown=shutdown)
    for refuse in (s.check_room, lambda: s.add(req("late"))):
        with pytest.raises(EngineUnavailable) as caught:
            refuse()
        assert caught.value.code == code
        assert (caught.value.retry_after is not None) is shutdown


def test_a_stopped_engine_with_no_failure_is_shutting_down_not_dead():
    from types import SimpleNamespace

    from scheduler.service import GenerationService

    for failure, code in ((None, "server_shutdown"), ("boom", "engine_unavailable")):
        engine = SimpleNamespace(alive=False, ready=True, failure=failure)
        service = GenerationService(make(), None, engine)  # type: ignore[arg-type]
        with pytest.raises(EngineUnavailable) as caught:
            service.check_available()
        assert caught.value.code == code
