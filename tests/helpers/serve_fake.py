"""`kvwarm serve`'s server loop around a model-free engine, for tests that need a
real process (signals, exit codes): python -m tests.helpers.serve_fake PORT [STEP_S] [SHUTDOWN_S] [HEADER_S]

SIGUSR1 makes the engine thread die (as a fault no request owns would)."""

from __future__ import annotations

import logging
import signal
import sys

from app.lifecycle import GracefulServer, server_config
from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine


def main(port: int, step_s: float = 0.05, shutdown_s: float = 30.0, header_s: float = 30.0) -> int:
    logging.basicConfig(level=logging.INFO)
    settings = Settings(
        _env_file=None, port=port, shutdown_timeout=shutdown_s, header_timeout=header_s
    )
    engines: list[FakeEngine] = []

    def engine(scheduler, router) -> FakeEngine:
        engines.append(FakeEngine(scheduler, router, step_delay=step_s, on_fatal=on_fatal))
        return engines[-1]

    def on_fatal(reason: str) -> None:
        server.engine_died(reason)

    app = create_app(settings, engine)
    server = GracefulServer(server_config(app, settings), app, shutdown_s)
    signal.signal(signal.SIGUSR1, lambda *_: engines[0].inject_fault(RuntimeError("injected")))
    server.run()
    return server.leave()


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), *map(float, sys.argv[2:])))
