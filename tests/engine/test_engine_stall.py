"""A stuck engine step, on a tiny random llama: the step blocks on an Event.

A step that never returns (a GPU hang, swap thrash, a long recovery) left
/health 200 and every deadline unenforced: the watchdog ran only inside the
engine's own loop. Waits here are upper bounds for "it happened", never timings.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from app.server import create_app
from app.settings import Settings
from engine.engine_thread import EngineConfig, EngineThread
from engine.model_source import ModelSource
from tests.helpers.http_server import serve_app

CHAT = "/v1/chat/completions"
WAIT_S = 20.0  # an upper bound for what must happen, never a measured duration


class Gate:
    """Holds the engine's next step (once ``when`` holds) until released."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def wrap(self, runner, when: Callable[[], bool] = lambda: True) -> None:
        step = runner.step

        def held_step(*args, **kwargs):
            if self.armed.is_set() and when():
                self.entered.set()
                self.release.wait(2 * WAIT_S)  # bounded: a failed test still ends
            return step(*args, **kwargs)

        runner.step = held_step


@contextmanager
def tiny_server(model_dir, gate: Gate, when=lambda r: True, **settings) -> Iterator[tuple]:
    config = EngineConfig(source=ModelSource("mlx", model_dir, "tiny"), prefill_step_size=32)
    holder: dict = {}

    def factory(scheduler, router):
        holder["engine"] = EngineThread(config, scheduler, router)
        return holder["engine"]

    app = create_app(Settings(_env_file=None, **settings), factory)
    try:
        with serve_app(app) as url:
            engine = holder["engine"]
            gate.wrap(engine._runner, lambda: when(engine._runner))  # noqa: SLF001
            yield url, app, engine
            gate.release.set()
    finally:
        gate.release.set()


def until(check: Callable[[], object], what: str) -> object:
    deadline = time.monotonic() + WAIT_S
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def background(url: str, body: dict, results: dict, name: str) -> threading.Thread:
    """POST ``body`` on a thread; its response (or the exception) lands in ``results``."""

    def post() -> None:
        try:
            results[name] = httpx.post(url + CHAT, json=body, timeout=WAIT_S)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[name] = exc

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def chat(max_tokens: int = 400, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def test_a_step_running_past_the_stall_timeout_turns_health_503_until_it_returns(
    tiny_llama_dir,
):
    gate = Gate()
    with tiny_server(tiny_llama_dir, gate, stall_timeout=0.2) as (url, _, _engine):
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        gate.armed.set()
        client = background(url, chat(4), {}, "stalled")
        assert gate.entered.wait(WAIT_S)
        stalled = until(
            lambda: (r := httpx.get(url + "/health")).status_code == 503 and r,
            "/health 503 while the step hangs",
        )
        body = stalled.json()
        assert body["status"] == "stalled"
        assert body["step_running_s"] >= 0.2  # past the threshold (rounded to ms)
        assert stalled.headers["retry-after"]
        stats = httpx.get(url + "/stats").json()
        assert stats["status"] == "stalled" and stats["engine"]["step_running_s"] >= 0.2
        gate.armed.clear()
        gate.release.set()
        until(lambda: httpx.get(url + "/health").status_code == 200, "/health ok again")
        client.join(WAIT_S)
        assert httpx.get(url + "/stats").json()["engine"]["step_running_s"] is None  # idle


def test_a_stall_timeout_of_zero_never_reports_a_stall(tiny_llama_dir):
    """The control for the test above: the same hang, the check turned off."""
    gate = Gate()
    with tiny_server(tiny_llama_dir, gate, stall_timeout=0) as (url, _, engine):
        gate.armed.set()
        client = background(url, chat(4), {}, "stalled")
        assert gate.entered.wait(WAIT_S)
        until(lambda: engine.busy_since is not None, "the engine reports its step")
        time.sleep(0.3)  # past what turned the test above 503 (not a timing assertion)
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        gate.release.set()
        client.join(WAIT_S)


def sse_choices(text: str) -> tuple[list[dict], dict]:
    """A streamed chat reply's choices, and its usage chunk."""
    events = [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    usage = next(e["usage"] for e in events if e.get("usage"))
    return [e["choices"][0] for e in events if e.get("choices")], usage


def test_request_deadlines_are_enforced_while_the_engine_step_hangs(tiny_llama_dir, monkeypatch):
    """The running request ends as the engine's watchdog ends it (finish length with
    what it generated), the queued one with 503 queue_timeout; each is counted once
    as a watchdog end, and the engine drops the row once its step returns."""
    monkeypatch.setattr("scheduler.service.DEADLINE_GRACE_S", 0.0, raising=False)
    gate = Gate()
    settings = {"batch": 1, "request_timeout": 1.0, "stall_timeout": 0}
    results: dict = {}
    with tiny_server(
        tiny_llama_dir, gate, lambda runner: runner.generated_tokens >= 3, **settings
    ) as (url, app, engine):
        gate.armed.set()
        body = chat(400, stream=True, stream_options={"include_usage": True})
        running = background(url, body, results, "running")
        assert gate.entered.wait(WAIT_S)  # 3 tokens out, then the step hangs
        queued = background(url, chat(4), results, "queued")
        running.join(WAIT_S)
        queued.join(WAIT_S)
        stats = httpx.get(url + "/stats").json()
        assert not gate.release.is_set()  # all of it while the engine was stuck
        gate.armed.clear()
        gate.release.set()
        until(lambda: engine.engine_stats().active_rows == 0, "the row is dropped")
        after = httpx.get(url + "/stats").json()["requests"]
        ok = httpx.post(url + CHAT, json=chat(2), timeout=WAIT_S)
    streamed, refused = results["running"], results["queued"]
    assert isinstance(streamed, httpx.Response), streamed
    choices, usage = sse_choices(streamed.text)
    assert choices[-1]["finish_reason"] == "length"
    assert usage["completion_tokens"] >= 3  # what it generated is counted as delivered
    assert isinstance(refused, httpx.Response), refused
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "queue_timeout"
    assert stats["requests"]["watchdog"] == 2 and stats["requests"]["aborted"] == 2
    # counted once: the step's late outputs and the abort that follows add nothing
    assert after == stats["requests"] | {"admitted": after["admitted"]}
    assert (after["watchdog"], after["finished"], after["failed"]) == (2, 0, 0)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_calls_waiting_on_a_stalled_engine_get_a_503(tiny_llama_dir):
    """Control jobs run between steps: behind a hung one an adapter call waited for
    ever. Past --stall-timeout it is a 503; the engine still serves jobs afterwards."""
    gate = Gate()
    with tiny_server(tiny_llama_dir, gate, stall_timeout=0.2) as (url, _, engine):
        control = httpx.delete(url + "/v1/adapters/none", timeout=WAIT_S)
        assert control.status_code == 404  # the control: the engine answers it
        ran: list = []
        gate.armed.set()
        client = background(url, chat(4), {}, "stalled")
        assert gate.entered.wait(WAIT_S)
        stalled = httpx.delete(url + "/v1/adapters/none", timeout=WAIT_S)
        job = engine.control(ran.append)
        gate.armed.clear()
        gate.release.set()
        job.result(WAIT_S)
        client.join(WAIT_S)
    assert stalled.status_code == 503, stalled.text
    assert stalled.json()["error"]["code"] == "engine_stalled"
    assert stalled.headers["retry-after"]
    assert len(ran) == 1


def test_a_request_arriving_while_the_engine_is_stalled_is_refused_at_once(tiny_llama_dir):
    """Queued behind a hung step, a new request waited on keep-alives as long (for
    ever without --request-timeout): refused with a 503 a client or a balancer can
    act on. The control: the same request is served before and after the stall."""
    gate = Gate()
    with tiny_server(tiny_llama_dir, gate, stall_timeout=0.2) as (url, _, _engine):
        before = httpx.post(url + CHAT, json=chat(2), timeout=WAIT_S)
        gate.armed.set()
        client = background(url, chat(4), {}, "stalled")
        assert gate.entered.wait(WAIT_S)
        until(lambda: httpx.get(url + "/health").status_code == 503, "stalled")
        refused = httpx.post(url + CHAT, json=chat(2), timeout=WAIT_S)
        gate.armed.clear()
        gate.release.set()
        client.join(WAIT_S)
        until(lambda: httpx.get(url + "/health").status_code == 200, "/health ok again")
        after = httpx.post(url + CHAT, json=chat(2), timeout=WAIT_S)
    assert before.status_code == 200 and after.status_code == 200
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "engine_stalled"
    assert refused.headers["retry-after"]
