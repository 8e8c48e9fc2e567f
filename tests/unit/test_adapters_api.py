"""/v1/adapters and the per-request ``adapter`` field over HTTP (model-free engine).

The fake engine's rows of an adapter write "<id>-w0 <id>-w1 ...", so each test
sees which adapter a request really ran with."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from app.settings import Settings
from tests.helpers.http_server import serve_app
from tests.helpers.safetensors_bytes import one_element_tensors
from tests.unit.test_http_api import assert_error, make_app

ADAPTERS = "/v1/adapters"


@pytest.fixture()
def base():
    with serve_app(make_app(eos_after=3)) as url:
        yield url


def chat(adapter_field: dict) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **adapter_field}


def test_mount_list_select_and_unmount(base, adapter_dir):
    r = httpx.post(base + ADAPTERS, json={"id": "sql", "path": str(adapter_dir), "scale": 0.5})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "sql" and r.json()["scale"] == 0.5
    listed = httpx.get(base + ADAPTERS).json()
    assert [a["id"] for a in listed["data"]] == ["sql"]
    assert set(listed["data"][0]) >= {"id", "path", "rank", "scale", "size_bytes", "mounted_layers"}
    # top level, extra_body and metadata all select it, in every dialect
    for body in (
        chat({"adapter": "sql"}),
        chat({"extra_body": {"adapter": "sql"}}),
        chat({"metadata": {"adapter": "sql"}}),
    ):
        r = httpx.post(base + "/v1/chat/completions", json=body)
        assert r.json()["choices"][0]["message"]["content"].startswith("sql-w0"), r.text
    r = httpx.post(
        base + "/v1/messages",
        json={
            "model": "m",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"adapter": "sql"},
        },
    )
    assert r.json()["content"][0]["text"].startswith("sql-w0"), r.text
    r = httpx.post(base + "/v1/responses", json={"input": "hi", "adapter": "sql"})
    assert r.json()["output"][0]["content"][0]["text"].startswith("sql-w0"), r.text
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "adapter": "sql"})
    assert r.json()["choices"][0]["text"].startswith("sql-w0"), r.text
    # no adapter: the base model
    r = httpx.post(base + "/v1/chat/completions", json=chat({}))
    assert r.json()["choices"][0]["message"]["content"].startswith("w0")
    r = httpx.delete(base + ADAPTERS + "/sql")
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert httpx.get(base + ADAPTERS).json()["data"] == []
    err = assert_error(
        httpx.post(base + "/v1/chat/completions", json=chat({"adapter": "sql"})), 400
    )
    assert err["code"] == "adapter_not_found" and err["param"] == "adapter"


def test_an_unmounted_adapters_metric_series_go_with_it(base, adapter_dir):
    """Adapter ids are clients' names: mounted, used and unmounted over and over,
    each one stayed a label value on /metrics for good."""
    for i in range(3):
        name = f"churn-{i}"
        assert httpx.post(base + ADAPTERS, json={"id": name, "path": str(adapter_dir)}).is_success
        assert httpx.post(base + "/v1/chat/completions", json=chat({"adapter": name})).is_success
        assert f'adapter="{name}"' in httpx.get(base + "/metrics").text
        assert httpx.delete(base + ADAPTERS + f"/{name}").is_success
    metrics = httpx.get(base + "/metrics").text
    assert 'adapter="churn-' not in metrics
    assert 'adapter=""' in metrics  # the base model's series stay
    # mounted again under a forgotten id: its requests are its own again
    assert httpx.post(base + ADAPTERS, json={"id": "churn-0", "path": str(adapter_dir)}).is_success
    assert httpx.post(base + "/v1/chat/completions", json=chat({"adapter": "churn-0"})).is_success
    assert 'adapter="churn-0"' in httpx.get(base + "/metrics").text


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/chat/completions", chat({"adapter": "nope"})),
        ("/v1/chat/completions", chat({"extra_body": {"adapter": "nope"}})),
        ("/v1/completions", {"prompt": "hi", "metadata": {"adapter": "nope"}}),
        ("/v1/responses", {"input": "hi", "adapter": "nope"}),
        (
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "x"}],
                "adapter": "nope",
            },
        ),
        ("/v1/chat/completions", chat({"adapter": 7})),
        ("/v1/chat/completions", chat({"adapter": ""})),
    ],
)
def test_unknown_or_malformed_adapter_is_400(base, route, body):
    r = httpx.post(base + route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]  # Anthropic's error shape has no param: the message names it
    assert "adapter" in (err.get("param") or "") or "adapter" in err["message"]


def test_mount_errors(base, adapter_dir, tmp_path_factory):
    empty = tmp_path_factory.mktemp("empty")
    err = assert_error(httpx.post(base + ADAPTERS, json={"id": "a", "path": str(empty)}), 400)
    assert err["code"] == "invalid_adapter" and "adapter_config.json" in err["message"]
    assert_error(httpx.post(base + ADAPTERS, json={"id": "../x", "path": str(adapter_dir)}), 400)
    assert_error(httpx.post(base + ADAPTERS, json={"id": "a", "path": "x" * 5000}), 400)
    # "~name" of no user on this machine: expanduser raises (it was a 500; schemathesis found it)
    err = assert_error(httpx.post(base + ADAPTERS, json={"id": "f", "path": "~\u0019"}), 400)
    assert "no such home directory" in err["message"]
    assert_error(
        httpx.post(base + ADAPTERS, json={"id": "a", "path": str(adapter_dir), "scale": -1}), 400
    )
    assert (
        httpx.post(base + ADAPTERS, json={"id": "a", "path": str(adapter_dir)}).status_code == 200
    )
    err = assert_error(httpx.post(base + ADAPTERS, json={"id": "a", "path": str(adapter_dir)}), 409)
    assert err["code"] == "adapter_exists" and "already mounted" in err["message"]
    assert_error(httpx.delete(base + ADAPTERS + "/unknown"), 404, "adapter_not_found")
    # the base model's own id: every request naming the base model would run the adapter
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    err = assert_error(
        httpx.post(base + ADAPTERS, json={"id": model, "path": str(adapter_dir)}), 409
    )
    assert err["code"] == "adapter_exists" and err["param"] == "id"
    assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]].count(model) == 1


def test_unmount_while_in_use_is_409_and_the_request_finishes(adapter_dir):
    with serve_app(make_app(eos_after=40, step_delay=0.05)) as base:
        assert (
            httpx.post(base + ADAPTERS, json={"id": "a", "path": str(adapter_dir)}).status_code
            == 200
        )
        result = {}

        def run():
            result["r"] = httpx.post(
                base + "/v1/chat/completions",
                json={**chat({"adapter": "a"}), "max_tokens": 30},
                timeout=30,
            )

        t = threading.Thread(target=run)
        t.start()
        for _ in range(100):
            stats = httpx.get(base + "/stats").json()
            if stats["batch"]["running_requests"]:
                break
            threading.Event().wait(0.02)
        err = assert_error(httpx.delete(base + ADAPTERS + "/a"), 409, "adapter_in_use")
        assert "in use" in err["message"]
        t.join()
        assert result["r"].status_code == 200
        assert result["r"].json()["choices"][0]["message"]["content"].startswith("a-w0")
        assert httpx.delete(base + ADAPTERS + "/a").status_code == 200


def test_adapter_flag_mounts_at_start_and_admission_counts_it(adapter_dir):
    settings = Settings(_env_file=None, adapter=[f"boot={adapter_dir}"])
    with serve_app(make_app(settings, eos_after=3, adapters=settings.adapters)) as base:
        assert [a["id"] for a in httpx.get(base + ADAPTERS).json()["data"]] == ["boot"]
        admission = httpx.get(base + "/stats").json()["admission"]
        assert admission["adapter_bytes"] == 4096 and admission["adapters"] == ["boot"]
        r = httpx.post(base + "/v1/chat/completions", json=chat({"adapter": "boot"}))
        assert r.json()["choices"][0]["message"]["content"].startswith("boot-w0")


def test_adapter_setting_takes_id_path_pairs(monkeypatch):
    from pydantic import ValidationError

    assert Settings(_env_file=None, adapter=["a=/x", "b=~/y"]).adapters[0] == ("a", Path("/x"))
    monkeypatch.setenv("KVWARM_ADAPTER", "c=/z, d=/w")
    assert [i for i, _ in Settings(_env_file=None).adapters] == ["c", "d"]
    for bad in (["nopath"], ["a=/x", "a=/y"], ["bad id=/x"]):
        with pytest.raises(ValidationError):
            Settings(_env_file=None, adapter=bad)


def test_a_model_name_that_is_an_adapter_selects_it_and_models_lists_it(base, adapter_dir):
    assert (
        httpx.post(base + ADAPTERS, json={"id": "sql", "path": str(adapter_dir)}).status_code == 200
    )
    models = httpx.get(base + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["fake-model", "sql"]
    assert models[1]["parent"] == "fake-model" and models[1]["root"] == str(adapter_dir)
    r = httpx.post(base + "/v1/chat/completions", json={**chat({}), "model": "sql"})
    assert r.json()["choices"][0]["message"]["content"].startswith("sql-w0")
    assert r.json()["model"] == "sql"  # named after the adapter it ran with, as vLLM does
    m = httpx.post(
        base + "/v1/messages",
        json={"max_tokens": 3, "messages": [{"role": "user", "content": "x"}], "adapter": "sql"},
    )
    assert m.json()["model"] == "sql"
    assert (
        httpx.post(base + "/v1/responses", json={"input": "x", "model": "sql"}).json()["model"]
        == "sql"
    )
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "model": "sql"})
    assert r.json()["choices"][0]["text"].startswith("sql-w0")
    # any other model name is the base model, as before
    r = httpx.post(base + "/v1/chat/completions", json={**chat({}), "model": "gpt-4o"})
    assert r.json()["choices"][0]["message"]["content"].startswith("w0")
    assert r.json()["model"] == "fake-model"


def test_a_mount_that_would_overcommit_admitted_requests_is_refused(adapter_dir):
    """Admission promised the running request its KV: an adapter that would take
    part of it is refused while it runs (503 with Retry-After: a 400 said it never
    would), and fits once it is gone."""
    app = make_app(eos_after=None, step_delay=0.02, context_length=8192, kv_budget_tokens=4096)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000, "stream": True}
    mount = {"id": "big", "path": str(adapter_dir)}
    with serve_app(app) as base:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as s:
            lines = s.iter_lines()
            while '"w0' not in next(lines):  # its first token: admitted with 4000 tokens of KV
                pass
            refused = httpx.post(base + ADAPTERS, json=mount)
            err = assert_error(refused, 503, "adapter_no_room_now")
            assert "running requests" in err["message"] and refused.headers["Retry-After"]
            assert httpx.get(base + ADAPTERS).json()["data"] == []
        for _ in range(200):  # the client left: the request ends
            if not httpx.get(base + "/stats").json()["batch"]["running_requests"]:
                break
            threading.Event().wait(0.02)
        assert httpx.post(base + ADAPTERS, json=mount).status_code == 200


def test_an_adapter_unmounted_between_validation_and_start_is_a_400(adapter_dir):
    app = make_app(eos_after=3)
    with serve_app(app) as base:
        assert (
            httpx.post(base + ADAPTERS, json={"id": "a", "path": str(adapter_dir)}).status_code
            == 200
        )
        engine = app.state.kvwarm.engine
        del engine.fake.adapters["a"]  # gone from the engine; the HTTP snapshot still lists it
        r = httpx.post(base + "/v1/chat/completions", json=chat({"adapter": "a"}))
        err = assert_error(r, 400, "adapter_not_found")
        assert "no adapter 'a' is mounted" in err["message"]
        assert httpx.get(base + "/health").status_code == 200


def test_an_adapter_flag_under_the_base_models_id_stops_the_start(adapter_dir):
    """It would take every request naming the base model (as /v1/models lists it)."""
    import asyncio

    from scheduler.scheduler import Scheduler
    from scheduler.streams import OutputRouter
    from tests.helpers.fake_engine import FakeEngine

    loop = asyncio.new_event_loop()
    try:
        engine = FakeEngine(
            Scheduler(None, max_running=1, max_queue=4),
            OutputRouter(loop),
            adapters=(("fake-model", adapter_dir),),
        )
        engine.start()
        engine.join(30)
        assert not engine.ready and "the base model's id" in (engine.failure or "")
    finally:
        loop.close()


def test_load_failures_say_whether_the_next_start_would_fail_alike(tmp_path):
    """Every load failure exited 1 ("try again"): a supervisor restarted a server
    whose --adapter, model or budget could never work, forever."""
    import asyncio

    from engine.engine_thread import EngineConfig, EngineThread
    from engine.model_errors import NoRoomForKV, UnsupportedModelError
    from scheduler.scheduler import Scheduler
    from scheduler.streams import OutputRouter
    from tests.helpers.fake_engine import FakeEngine

    loop = asyncio.new_event_loop()
    seen: list[tuple[str, bool]] = []

    def record(reason: str, lasting: bool) -> None:
        seen.append((reason, lasting))

    def failing(exc: Exception):
        def boot(_config):
            raise exc

        return boot

    try:
        for adapters in ((("fake-model", tmp_path),), (("a", tmp_path / "missing"),)):
            engine = FakeEngine(
                Scheduler(None, max_running=1, max_queue=4),
                OutputRouter(loop),
                adapters=adapters,  # the base model's id: lasting; a path not there: maybe not
                on_load_failure=record,
            )
            engine.start()
            engine.join(30)
        for exc in (UnsupportedModelError("x"), NoRoomForKV("y"), OSError("disk busy")):
            thread = EngineThread(
                EngineConfig(source=None),  # type: ignore[arg-type]  # never loaded
                Scheduler(None, max_running=1, max_queue=4),
                OutputRouter(loop),
                on_load_failure=record,
                boot=failing(exc),
            )
            thread.start()
            thread.join(30)
    finally:
        loop.close()
    assert [lasting for _, lasting in seen] == [True, False, True, True, False]
    assert "--adapter fake-model=" in seen[0][0] and "--adapter a=" in seen[1][0]


def test_a_lasting_load_failure_is_logged_without_a_traceback(caplog):
    """A failure every start meets again (the model, the settings) came as three
    chained tracebacks: the reason is one line, a traceback only for the others."""
    import asyncio
    import logging

    from engine.engine_thread import EngineConfig, EngineThread
    from engine.model_errors import UnsupportedModelError
    from scheduler.scheduler import Scheduler
    from scheduler.streams import OutputRouter

    loop = asyncio.new_event_loop()

    def failing(exc: Exception):
        def boot(_config):
            try:
                raise ValueError("Model type foomodel not supported.")
            except ValueError as cause:
                raise exc from cause

        return boot

    try:
        for exc in (UnsupportedModelError("mlx-lm cannot load m"), RuntimeError("odd")):
            thread = EngineThread(
                EngineConfig(source=None),  # type: ignore[arg-type]  # never loaded
                Scheduler(None, max_running=1, max_queue=4),
                OutputRouter(loop),
                boot=failing(exc),
            )
            with caplog.at_level(logging.ERROR, logger="kvwarm.engine"):
                thread.start()
                thread.join(30)
    finally:
        loop.close()
    failed = [r for r in caplog.records if "model load failed" in r.getMessage()]
    assert [r.getMessage() for r in failed] == [
        "model load failed: mlx-lm cannot load m",
        "model load failed: odd",
    ]
    assert failed[0].exc_info is None and failed[1].exc_info is not None


def test_a_load_that_fails_after_the_boot_closes_what_the_boot_made(tmp_path):
    """An --adapter that failed to mount returned before the close: the runner's
    disk tier was not flushed and a group's other ranks, never told to stop, sat
    until their heartbeat timed out."""
    import asyncio

    from scheduler.scheduler import Scheduler
    from scheduler.streams import OutputRouter
    from tests.helpers.fake_engine import FakeEngine

    class Ranks:
        closed = False

        def start(self, on_lost) -> None:
            pass

        def close(self) -> None:
            Ranks.closed = True

    loop = asyncio.new_event_loop()
    closed: list[bool] = []
    try:
        engine = FakeEngine(
            Scheduler(None, max_running=1, max_queue=4),
            OutputRouter(loop),
            adapters=(("fake-model", tmp_path),),  # the base model's id: refused
            ranks=Ranks(),
        )
        engine.fake.close = lambda: closed.append(True)  # type: ignore[method-assign]
        engine.fake.failure = None  # type: ignore[attr-defined]  # a group's runner has one
        engine.start()
        engine.join(30)
    finally:
        loop.close()
    assert engine._failure and "--adapter fake-model=" in engine._failure  # noqa: SLF001
    assert closed == [True] and Ranks.closed
    assert "--adapter fake-model=" in engine.fake.failure  # the others stop as failed


def test_a_start_that_fails_leaves_no_idle_wait_while_requests_queue():
    """The slot a failed start frees goes to the queue's next request at once: the
    engine waited out its idle timeout first (a run of failing requests got 2 a second)."""
    import asyncio

    from scheduler.request import Request
    from scheduler.scheduler import Scheduler
    from scheduler.service import GenerationService
    from scheduler.streams import OutputRouter
    from tests.helpers.fake_engine import FakeEngine

    async def run() -> list[int]:
        scheduler = Scheduler(None, max_running=1, max_queue=8)
        idle_with_queue: list[int] = []
        wait = scheduler.wait_for_work

        def recording_wait(timeout: float) -> None:
            waiting = scheduler.stats().waiting  # then: no wake-up pending for them
            idle_with_queue.append(0 if scheduler._wake.is_set() else waiting)  # noqa: SLF001
            wait(timeout)

        scheduler.wait_for_work = recording_wait  # type: ignore[method-assign]
        router = OutputRouter(asyncio.get_running_loop())
        engine = FakeEngine(scheduler, router, eos_after=2)
        service = GenerationService(scheduler, router, engine)
        engine.start()
        engine.wait_ready(5)
        try:
            for _ in range(3):
                failing = service.submit(Request([1, 2, 3], 4, adapter="not-mounted"))
                fine = service.submit(Request([1, 2, 3], 4))
                assert [o async for o in failing][-1].error_code == "adapter_not_found"
                assert [o async for o in fine][-1].finish_reason is not None
        finally:
            engine.stop()
            engine.join(5)
        return idle_with_queue

    assert not any(asyncio.run(run()))


def test_a_control_sent_as_the_engine_dies_is_answered():
    """An adapter mount (or a conversation save) checked the engine was up, then the
    engine died and drained its controls before the op was queued: it waited for
    ever, and so did its HTTP handler."""
    import asyncio

    from scheduler.admission import EngineUnavailable
    from scheduler.scheduler import Scheduler
    from scheduler.streams import OutputRouter
    from tests.helpers.fake_engine import FakeEngine

    loop = asyncio.new_event_loop()
    engine = FakeEngine(Scheduler(None, max_running=1, max_queue=4), OutputRouter(loop))
    engine.start()
    assert engine.wait_ready(5)
    controls = engine._controls  # noqa: SLF001

    class LateQueue:  # the engine dies between control()'s check and its put
        def put(self, item) -> None:
            engine.inject_fault(RuntimeError("GPU fell over"))
            engine.join(5)  # its last drain of the controls is over
            controls.put(item)

        def get_nowait(self):
            return controls.get_nowait()

        def qsize(self) -> int:
            return controls.qsize()

    engine._controls = LateQueue()  # noqa: SLF001
    try:
        future = engine.control(lambda runner: "ran")
        assert future.done()
        with pytest.raises(EngineUnavailable):
            future.result(0)
    finally:
        loop.close()


def test_a_model_naming_an_adapter_unmounted_since_is_a_404_not_the_base_model(base, adapter_dir):
    """It answered 200 from the base model under the adapter's name: a silent wrong
    answer for routers that select adapters through ``model``."""
    assert (
        httpx.post(base + ADAPTERS, json={"id": "sql", "path": str(adapter_dir)}).status_code == 200
    )
    assert httpx.delete(base + ADAPTERS + "/sql").status_code == 200
    r = httpx.post(base + "/v1/chat/completions", json={**chat({}), "model": "sql"})
    assert_error(r, 404, "model_not_found")
    other = httpx.post(base + "/v1/chat/completions", json={**chat({}), "model": "anything"})
    assert other.status_code == 200  # any other name is the base model, as before


def test_weights_larger_than_the_whole_kv_budget_are_refused_before_they_are_read(
    base, adapter_dir, tmp_path
):
    """The whole file was read into memory (then copied again by the loader)
    before the budget was asked: a multi-GB path could take the server down."""
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    with open(big / "adapters.safetensors", "wb") as f:
        f.truncate(64 * 2**20)  # sparse: nothing to read if it is never read
    r = httpx.post(base + ADAPTERS, json={"id": "big", "path": str(big)})
    err = assert_error(r, 400, "adapter_over_budget")
    assert "could never be mounted" in err["message"]


def test_a_control_that_escapes_as_a_base_exception_answers_its_caller():
    """The op's future was running when a BaseException left it: the engine died,
    and its last drain of the controls never saw that future, so the route awaiting
    it hung for good."""
    import asyncio
    from concurrent.futures import TimeoutError as FutureTimeout

    from scheduler.admission import EngineUnavailable
    from scheduler.scheduler import Scheduler
    from scheduler.streams import OutputRouter
    from tests.helpers.fake_engine import FakeEngine

    class Interrupted(BaseException):
        pass

    def op(runner):
        raise Interrupted("stop")

    loop = asyncio.new_event_loop()
    engine = FakeEngine(Scheduler(None, max_running=1, max_queue=4), OutputRouter(loop))
    engine.start()
    assert engine.wait_ready(5)
    try:
        future = engine.control(op)
        try:
            future.exception(5)
        except FutureTimeout:
            pytest.fail("the control's caller was never answered")
        # answered as the engine's end, not with the exception itself: a SystemExit
        # set on the future was raised out of the event loop that awaited it
        assert isinstance(future.exception(0), EngineUnavailable)
        assert "Interrupted: stop" in str(future.exception(0))
        engine.join(5)
        assert not engine.alive  # it still ends the engine, as any escape does
    finally:
        engine.stop()
        loop.close()


def test_a_header_past_the_models_tensor_bound_is_refused_before_the_engine_sees_it(
    adapter_dir,
):
    """The tensors were built on the engine thread (mx.load) before any was checked:
    their count is bounded by the model's linear layers (a lora_a, lora_b and m each)."""
    from dataclasses import replace

    mounts: list[str] = []
    (adapter_dir / "adapters.safetensors").write_bytes(one_element_tensors(7))
    app = make_app(eos_after=3)
    with serve_app(app) as base:
        engine = app.state.kvwarm.engine
        engine.info = replace(engine.info, adapter_layers=2)  # room for 6 tensors
        fake_mount = engine.fake.mount_adapter
        engine.fake.mount_adapter = lambda i, *a: mounts.append(i) or fake_mount(i, *a)
        r = httpx.post(base + ADAPTERS, json={"id": "many", "path": str(adapter_dir)})
        err = assert_error(r, 400, "invalid_adapter")
        assert "7 tensors, more than the 6" in err["message"]
        (adapter_dir / "adapters.safetensors").write_bytes(one_element_tensors(6))
        assert httpx.post(base + ADAPTERS, json={"id": "six", "path": str(adapter_dir)}).is_success
    assert mounts == ["six"]


def test_weights_that_fit_once_others_are_unmounted_are_not_called_never_mountable(
    adapter_dir, tmp_path
):
    """The "could never be mounted" limit was the KV budget left beside the
    adapters mounted now: weights that fit once one of them is unmounted were
    refused as for good, unread. The engine now answers them (unmount another)."""
    from tests.helpers.safetensors_bytes import safetensors_of_size

    app = make_app(eos_after=3, kv_budget_tokens=1940)
    with serve_app(app) as base:
        for i in range(4):  # the fake engine's adapters hold 4096 bytes each
            mount = {"id": f"m{i}", "path": str(adapter_dir)}
            assert httpx.post(base + ADAPTERS, json=mount).is_success
        room = app.state.kvwarm.engine.model_info.budget.kv_budget_bytes
        big = tmp_path / "big"
        big.mkdir()
        (big / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
        (big / "adapters.safetensors").write_bytes(safetensors_of_size(room + 64))
        err = assert_error(httpx.post(base + ADAPTERS, json={"id": "big", "path": str(big)}), 400)
        assert "never" not in err["message"] and "unmount another" in err["message"]
        for i in range(4):
            assert httpx.delete(base + ADAPTERS + f"/m{i}").is_success
        assert httpx.post(base + ADAPTERS, json={"id": "big", "path": str(big)}).is_success


def test_mounts_read_one_at_a_time_and_a_mounted_id_is_refused_unread(adapter_dir, monkeypatch):
    """Each POST read its whole file in a worker before the engine was asked
    anything: 16 POSTs of one id read 6 copies at once, each under the limit."""
    import time

    import app.adapters_api as api

    read = api.read_adapter_files
    lock = threading.Lock()
    seen = {"now": 0, "peak": 0, "reads": 0}

    def slow_read(*args, **kwargs):  # a slow disk, a file of gigabytes
        with lock:
            seen["now"] += 1
            seen["reads"] += 1
            seen["peak"] = max(seen["peak"], seen["now"])
        try:
            time.sleep(0.05)
            return read(*args, **kwargs)
        finally:
            with lock:
                seen["now"] -= 1

    monkeypatch.setattr(api, "read_adapter_files", slow_read)
    statuses: dict[str, list[int]] = {"same": [], "other": []}

    def post(adapter_id: str, key: str) -> None:
        r = httpx.post(
            base + ADAPTERS, json={"id": adapter_id, "path": str(adapter_dir)}, timeout=60
        )
        statuses[key].append(r.status_code)
        if r.status_code == 409:
            assert r.json()["error"]["code"] == "adapter_exists"

    with serve_app(make_app(eos_after=3)) as base:
        threads = [threading.Thread(target=post, args=("same", "same")) for _ in range(8)]
        threads += [threading.Thread(target=post, args=(f"o{i}", "other")) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert sorted(statuses["same"]) == [200] + [409] * 7
    assert statuses["other"] == [200] * 3
    assert seen["peak"] == 1  # never two files in memory at once
    assert seen["reads"] == 4  # the id mounted already: refused before its file was read


def test_an_adapter_flag_that_cannot_fit_stops_the_start_before_it_is_mounted(tmp_path):
    """--adapter was read with no size limit and mounted before the room was asked
    (a run-time mount does the opposite): one past the budget took the memory it
    keeps first. Refused as a lasting settings error (exit 2, no restart loop)."""
    import asyncio

    from scheduler.scheduler import Scheduler
    from scheduler.streams import OutputRouter
    from tests.helpers.fake_engine import FakeEngine
    from tests.helpers.safetensors_bytes import safetensors_of_size

    def adapter(name: str, size: int) -> Path:
        d = tmp_path / name
        d.mkdir()
        config = {"fine_tune_type": "lora", "lora_parameters": {"rank": 8, "scale": 1.0}}
        (d / "adapter_config.json").write_text(json.dumps(config))
        (d / "adapters.safetensors").write_bytes(safetensors_of_size(size))
        return d

    small, big = adapter("small", 100), adapter("big", 30_000)
    loop = asyncio.new_event_loop()
    seen: list[tuple[str, bool]] = []
    try:
        # ~46 KB of KV: 30 KB of weights (60 KB while mounting) never fit; two of
        # 20 KB do not fit together beside the first one's 4 KB
        for adapters in ((("big", big),), (("a", small), ("b", adapter("mid", 20_000)))):
            engine = FakeEngine(
                Scheduler(None, max_running=1, max_queue=4),
                OutputRouter(loop),
                adapters=adapters,
                on_load_failure=lambda reason, lasting: seen.append((reason, lasting)),
            )
            mounts: list[str] = []
            fake_mount = engine.fake.mount_adapter
            engine.fake.mount_adapter = (  # bound now: this round's list and mount
                lambda i, *a, m=mounts, f=fake_mount: m.append(i) or f(i, *a)
            )
            engine.start()
            engine.join(30)
            assert not engine.ready
            assert mounts == [i for i, _ in adapters[:-1]]  # the last never mounted
    finally:
        loop.close()
    assert [lasting for _, lasting in seen] == [True, True]
    assert "--adapter big=" in seen[0][0] and "could never be mounted" in seen[0][0]
    assert "--adapter b=" in seen[1][0] and "no KV budget" in seen[1][0]
    assert all("\n" not in reason for reason, _ in seen)


def test_an_adapter_flag_whose_files_cannot_be_mounted_stops_the_start_for_good(
    tmp_path, monkeypatch
):
    """A weights header the read refuses (a dtype, name or shape no adapter has, more
    tensors than the model has layers for) was a plain RuntimeError at start: exit 1,
    and a supervisor reloaded the model for ever to read the same bytes. An error
    reading the files (a mount not up yet) is still worth another start."""
    import asyncio
    import errno
    import os

    from engine import adapter_files
    from scheduler.scheduler import Scheduler
    from scheduler.streams import OutputRouter
    from tests.helpers.fake_engine import FakeEngine
    from tests.helpers.safetensors_bytes import safetensors

    def tensor(name: str = "model.layers.0.q.lora_a", dtype: str = "F16", shape=(1, 1)) -> bytes:
        size = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        entry = {"dtype": dtype, "shape": list(shape), "data_offsets": [0, size]}
        return safetensors({name: entry}, b"\0" * size)

    def adapter(name: str, weights: bytes) -> Path:
        d = tmp_path / name
        d.mkdir()
        config = {"fine_tune_type": "lora", "lora_parameters": {"rank": 1, "scale": 1.0}}
        (d / "adapter_config.json").write_text(json.dumps(config))
        (d / "adapters.safetensors").write_bytes(weights)
        return d

    refused = {
        "int": tensor(dtype="I16"),
        "name": tensor(name="model.layers.0.q.weight"),
        "shape": tensor(shape=(2,)),
        "many": one_element_tensors(4097),
        "no-json": safetensors({}).replace(b"{}", b"{("),
    }
    real_open = os.open

    def eio(path, *args, **kwargs):
        if str(path).endswith("eio/adapters.safetensors"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(adapter_files.os, "open", eio)
    cases = [(name, adapter(name, raw)) for name, raw in refused.items()]
    cases.append(("eio", adapter("eio", tensor())))
    loop = asyncio.new_event_loop()
    seen: list[tuple[str, bool]] = []
    try:
        for adapter_id, path in cases:
            engine = FakeEngine(
                Scheduler(None, max_running=1, max_queue=4),
                OutputRouter(loop),
                kv_budget_tokens=1 << 20,  # room for 4097 tensors' header
                adapters=((adapter_id, path),),
                on_load_failure=lambda reason, lasting: seen.append((reason, lasting)),
            )
            engine.start()
            engine.join(30)
            assert not engine.ready
    finally:
        loop.close()
    assert [lasting for _, lasting in seen] == [True] * len(refused) + [False], seen
    assert all(f"--adapter {i}=" in reason for (i, _), (reason, _) in zip(cases, seen))
