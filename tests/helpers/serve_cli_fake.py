"""`kvwarm serve` itself (app.cli.main, its end included) over a model-free engine,
for tests of how the process ends: python -m tests.helpers.serve_cli_fake MODE ARGS...

MODE ``load``: the model load does not return for two minutes. MODE ``step``: steps
take 50 ms until SIGUSR2, then a minute each (a long prefill). ARGS: kvwarm serve's.

As MLX's and OpenBLAS's busy worker threads do, the interpreter's teardown waits
until the engine thread's work is over: a process that leaves through it with the
engine still busy hangs (the real libraries then abort, SIGABRT)."""

from __future__ import annotations

import atexit
import logging
import signal
import sys
import time
from types import SimpleNamespace

from app import cli, server
from engine import engine_thread
from tests.helpers.fake_engine import FakeEngine

LOAD_S = 120.0
LONG_STEP_S = 60.0
ENGINE_JOIN_S = 1.0  # the lifespan's wait for the engine thread (20 s in the product)


def main(mode: str, argv: list[str]) -> int:
    engines: list[FakeEngine] = []

    def engine(config, scheduler, router, on_load_failure=None, on_fatal=None) -> FakeEngine:
        made = FakeEngine(
            scheduler, router, step_delay=0.05, on_fatal=on_fatal, on_load_failure=on_load_failure
        )
        if mode == "load":
            boot = made._boot

            def slow_boot(config):
                time.sleep(LOAD_S)
                return boot(config)

            made._boot = slow_boot
        atexit.register(made.join)  # the libraries' teardown, waiting on busy threads
        engines.append(made)
        return made

    def long_steps(*_) -> None:
        engines[0].fake.step_delay = LONG_STEP_S

    def runtime(settings):  # no model to resolve, no BLAS to load
        logging.basicConfig(level=logging.INFO)
        return SimpleNamespace(describe=lambda: "stub"), SimpleNamespace(path="/fake", kind="mlx")

    cli._prepare_runtime = runtime
    engine_thread.EngineThread = engine  # type: ignore[assignment,misc]
    server.ENGINE_JOIN_S = ENGINE_JOIN_S
    signal.signal(signal.SIGUSR2, long_steps)
    return cli.main(["serve", "--no-log-json", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
