"""`kvwarm serve`'s server loop around a model-free engine, for tests that need a
real process (signals, exit codes): python -m tests.helpers.serve_fake PORT [STEP_S] [SHUTDOWN_S]"""

from __future__ import annotations

import logging
import sys

import uvicorn

from app.lifecycle import GracefulServer
from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine


def main(port: int, step_s: float = 0.05, shutdown_s: float = 30.0) -> int:
    logging.basicConfig(level=logging.INFO)
    settings = Settings(_env_file=None, port=port, shutdown_timeout=shutdown_s)
    app = create_app(settings, lambda s, r: FakeEngine(s, r, step_delay=step_s))
    server = GracefulServer(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None), app, shutdown_s
    )
    server.run()
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), *map(float, sys.argv[2:])))
