"""SIGTERM must not look like a crash: streams end with their terminal event, new
requests get 503 + Retry-After meanwhile, and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.http_server import free_port, read_response, wait_for_process
from tests.helpers.serve_cli_fake import ENGINE_JOIN_S

ROOT = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "hi"}]
STREAMS = {
    "chat": ("/v1/chat/completions", {"messages": USER, "stream": True, "ignore_eos": True}),
    "messages": ("/v1/messages", {"messages": USER, "stream": True, "ignore_eos": True}),
    "responses": ("/v1/responses", {"input": "hi", "stream": True, "ignore_eos": True}),
}
LIMIT = {"chat": "max_tokens", "messages": "max_tokens", "responses": "max_output_tokens"}
CUT = "<connection cut>"


def start(tmp_path: Path, shutdown_s: float):
    port = free_port()
    log = tmp_path / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.serve_fake", str(port), "0.05", str(shutdown_s)],
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for_process(proc, url + "/health", log, "fake server", 30)
    return proc, url, log


def open_streams(url: str, tokens: int) -> tuple[dict[str, list[str]], list[threading.Thread]]:
    lines: dict[str, list[str]] = {k: [] for k in STREAMS}

    def read(kind: str) -> None:
        path, body = STREAMS[kind]
        try:
            with httpx.stream(
                "POST", url + path, json={**body, LIMIT[kind]: tokens}, timeout=60
            ) as r:
                for line in r.iter_lines():
                    lines[kind].append(line)
        except httpx.TransportError:
            lines[kind].append(CUT)

    threads = [threading.Thread(target=read, args=(k,)) for k in STREAMS]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while not all(len(v) > 3 for v in lines.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return lines, threads


def events(lines: list[str]) -> list[str]:
    return [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]


def data(lines: list[str]) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            raw = line[6:]
            out.append(raw if raw == "[DONE]" else json.loads(raw))
    return out


def assert_each_stream_failed(lines: dict[str, list[str]], *codes: str) -> None:
    """Every stream was written to its end, which is its dialect's error event
    with one of ``codes``."""
    assert not any(CUT in v for v in lines.values())
    chat = data(lines["chat"])
    assert chat[-1] == "[DONE]" and chat[-2]["error"]["code"] in codes
    assert events(lines["messages"])[-1] == "error"
    assert events(lines["responses"])[-1] == "response.failed"
    failed = data(lines["responses"])[-1]["response"]["error"]
    assert failed["code"] == "server_error"
    assert any(f"({c})" in failed["message"] for c in codes)  # its schema's own code


def test_sigterm_lets_running_streams_finish_and_exits_zero(tmp_path):
    proc, url, log = start(tmp_path, shutdown_s=30)
    try:
        lines, threads = open_streams(url, tokens=40)  # ~2 s each at 50 ms a step
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(url + "/v1/chat/completions", json={"messages": USER})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "server_shutdown"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert httpx.get(url + "/stats").json()["status"] == "draining"  # it said "ok"
        for t in threads:
            t.join(30)
        assert proc.wait(30) == 0, log.read_text()[-2000:]
    finally:
        proc.kill()
    assert not any(CUT in v for v in lines.values())
    chat = data(lines["chat"])
    assert chat[-1] == "[DONE]" and chat[-2]["choices"][0]["finish_reason"] == "length"
    assert events(lines["messages"])[-1] == "message_stop"
    assert events(lines["responses"])[-1] == "response.incomplete"  # cut by max_output_tokens


def test_a_request_still_sending_its_body_at_sigterm_is_answered_not_cut(tmp_path):
    """Not yet the scheduler's, it was not waited for: uvicorn cancelled it a few
    seconds later with a plain-text 500. Now it is answered: 503, retry later."""
    proc, url, log = start(tmp_path, shutdown_s=30)
    body = json.dumps({"messages": USER, "max_tokens": 4}).encode()
    port = int(url.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            head = (
                "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            sock.sendall(head.encode() + body[:10])
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            time.sleep(6)  # past uvicorn's own 5 s for tasks once the server exits
            sock.sendall(body[10:])
            response = read_response(sock)
        assert proc.wait(30) == 0, log.read_text()[-2000:]
    finally:
        proc.kill()
    assert response.startswith(b"HTTP/1.1 503"), response[:300]
    assert b"retry-after" in response.lower() and b"server_shutdown" in response


def test_streams_past_the_shutdown_timeout_end_with_their_error_event(tmp_path):
    proc, url, log = start(tmp_path, shutdown_s=0.5)
    try:
        lines, threads = open_streams(url, tokens=2000)  # far longer than the timeout
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert proc.wait(30) == 0, log.read_text()[-2000:]
    finally:
        proc.kill()
    assert_each_stream_failed(lines, "server_shutdown")
    assert data(lines["messages"])[-1]["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_second_signal_exits_at_once(tmp_path, sig, code):
    """It ran uvicorn's forced exit: status 0 (as if stopped cleanly), each open
    connection's CancelledError traceback in the log, and in `kvwarm serve` still
    the wait for the engine thread. Now it leaves at once with the shell's status
    for the signal."""
    proc, url, log = start(tmp_path, shutdown_s=30)
    try:
        lines, threads = open_streams(url, tokens=2000)
        proc.send_signal(sig)
        time.sleep(0.3)
        proc.send_signal(sig)
        assert proc.wait(15) == code, log.read_text()[-2000:]  # not after the 30 s drain
        for t in threads:
            t.join(15)
    finally:
        proc.kill()
    text = log.read_text()
    assert "second" in text and "CancelledError" not in text and "Traceback" not in text, text


def test_engine_death_ends_every_stream_and_exits_nonzero(tmp_path):
    proc, url, log = start(tmp_path, shutdown_s=30)
    try:
        lines, threads = open_streams(url, tokens=2000)
        proc.send_signal(signal.SIGUSR1)  # the engine thread dies
        for t in threads:
            t.join(30)
        assert proc.wait(30) == 1, log.read_text()[-2000:]  # a supervisor restarts it
    finally:
        proc.kill()
    # a stream still queued for memory (the fake budget runs one at a time) did not
    # fail itself: it is told the engine is unavailable, worth retrying
    assert_each_stream_failed(lines, "engine_error", "engine_unavailable")


def test_the_open_files_limit_is_raised_toward_the_hard_limit():
    """Each connection is a file: at a service manager's default a client holding
    that many idle connections left none for other agents."""
    import resource
    import subprocess
    import sys

    # a child process with a low soft limit, so this one's limits are untouched
    code = (
        "import resource\n"
        "from app.lifecycle import raise_open_files_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "before, after = raise_open_files_limit(4096)\n"
        "print(before, after, resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    expected = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    assert out == ["256", str(expected), str(expected)]


def test_a_refused_limit_steps_down_to_one_the_system_grants(monkeypatch):
    """macOS refuses a soft limit above kern.maxfilesperproc even under an
    'unlimited' hard limit: it must not stay at launchd's 256."""
    import resource

    from app.lifecycle import raise_open_files_limit

    granted: list[int] = []

    def setrlimit(which: int, limits: tuple[int, int]) -> None:
        if limits[0] > 61440:
            raise ValueError("not allowed")
        granted.append(limits[0])

    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert raise_open_files_limit() == (256, 61440) and granted == [61440]


def test_the_engine_thread_outliving_the_event_loop_raises_nothing():
    """An engine thread still running after the server's loop closed (past the exit
    join) ends its outputs and its death quietly, instead of raising on that thread."""
    import asyncio

    import uvicorn
    from fastapi import FastAPI

    from app.lifecycle import GracefulServer
    from scheduler.request import RequestOutput
    from scheduler.streams import OutputRouter

    loop = asyncio.new_event_loop()
    router = OutputRouter(loop)
    server = GracefulServer(uvicorn.Config(FastAPI()), FastAPI(), 1.0)
    server._loop = loop
    loop.close()
    router.publish([RequestOutput("r")])
    server.engine_died("boom")
    assert server.exit_code == 1 and server.should_exit


def start_cli(tmp_path: Path, mode: str, *flags: str):
    """`kvwarm serve` (app.cli) over the fake engine in ``mode`` (tests.helpers.serve_cli_fake)."""
    port = free_port()
    log = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWARM_")}
    env.update(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    argv = ["--port", str(port), "--kv-disk-bytes", "0", *flags]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.serve_cli_fake", mode, *argv],
        cwd=tmp_path,  # no .env of the checkout's
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}", log


def wait_answering(proc: subprocess.Popen, url: str, log: Path) -> httpx.Response:
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(url + "/health", timeout=2)
        except httpx.TransportError:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)


def test_sigterm_during_a_model_load_exits_without_waiting_for_it(tmp_path):
    """The engine thread still loading past the exit's wait for it: the process
    logged "Finished server process", then hung in the C libraries' teardown
    (OpenBLAS joining its busy workers) and died by SIGABRT (134). Nothing was
    being served, so nothing was cut: it exits 0, at once."""
    proc, url, log = start_cli(tmp_path, "load")
    try:
        assert wait_answering(proc, url, log).json()["status"] == "loading"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]  # the load lasts 120 s
    finally:
        proc.kill()
    text = log.read_text()
    assert f"still busy {ENGINE_JOIN_S:.0f} s after the stop" in text, text[-3000:]


def test_a_step_outlasting_the_shutdown_ends_each_stream_and_exits_one(tmp_path):
    """A step longer than the drain, the streams' flush and uvicorn's close: the
    streams waited for the engine's next step boundary, which never came in time,
    and were cut without their terminal event (curl: rc 18); then the process hung
    as above. Now each stream gets its dialect's server_shutdown error from the
    event loop, and the process exits 1: stopped, but not cleanly (the engine was
    abandoned in its step, requests cut)."""
    proc, url, log = start_cli(tmp_path, "step", "--shutdown-timeout", "0.5")
    try:
        wait_for_process(proc, url + "/health", log, "kvwarm serve", 30)
        lines, threads = open_streams(url, tokens=2000)
        proc.send_signal(signal.SIGUSR2)  # the next steps take a minute each
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(45)
        assert proc.wait(45) == 1, log.read_text()[-3000:]
    finally:
        proc.kill()
    assert_each_stream_failed(lines, "server_shutdown")
    assert "Traceback" not in log.read_text()


def test_streams_ended_by_the_loop_drop_the_engines_later_outputs():
    """Ended at the flush deadline from the event loop, a stream gets one final
    output: the engine's own end for it, published when its step returns, goes
    nowhere (a client counted once)."""
    import asyncio

    from scheduler.request import FinishReason, RequestOutput
    from scheduler.streams import OutputRouter

    async def scenario() -> list[RequestOutput]:
        router = OutputRouter(asyncio.get_running_loop())
        queue = router.open("r")
        assert router.end_open(RequestOutput.shutdown) == 1 and len(router) == 0
        router.publish([RequestOutput.shutdown("r")])  # the engine's, a step later
        await asyncio.sleep(0.05)
        return [queue.get_nowait() for _ in range(queue.qsize())]

    (only,) = asyncio.run(scenario())
    assert only.finish_reason is FinishReason.ERROR and only.error_code == "server_shutdown"
