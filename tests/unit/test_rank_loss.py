"""The serving rank's HTTP side when a rank of its group is lost (model-free)."""

from __future__ import annotations

import json

import httpx

from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import serve_app

CHAT = "/v1/chat/completions"


class FakeMonitor:
    """engine.rank_health.RankMonitor as the engine thread uses it."""

    def __init__(self) -> None:
        self.on_lost = None
        self.closed = False

    def start(self, on_lost) -> None:
        self.on_lost = on_lost

    def close(self) -> None:
        self.closed = True


def test_a_lost_rank_fails_open_streams_turns_health_503_and_asks_to_exit():
    monitor = FakeMonitor()
    fatal: list[str] = []

    def engine(scheduler, router):
        e = FakeEngine(scheduler, router, step_delay=0.01, ranks=monitor, on_fatal=fatal.append)
        e.rank_lost_exit_s = None  # the test process stays up
        return e

    app = create_app(Settings(_env_file=None), engine)
    with serve_app(app) as url:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", url + CHAT, json=body, timeout=10) as r:
            lines = r.iter_lines()
            next(lines)
            monitor.on_lost("rank 1 is lost: no heartbeat for 10.0s")
            events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        error = events[-1]["error"]
        assert error["code"] == "engine_error"
        assert "rank of the distributed group was lost: rank 1" in error["message"]
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "rank 1" in health.json()["error"]
        assert fatal and "rank 1" in fatal[0]  # the HTTP server exits non-zero on it
