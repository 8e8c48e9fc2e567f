"""A distributed group's start-up, bounded in time.

Every collective blocks until each rank joins it, and none has a timeout: a
rank that never started, hung while loading, or was launched with another world
size left the others waiting for ever, the serving rank's /health answering
"loading" all along and no supervisor the wiser. So each rank gives its start-up
``limit_s`` seconds (--distributed-boot-timeout); past that it says which stage
it was in and exits non-zero, and a supervisor restarts the group whole, as for
a rank lost later (engine.rank_health).

Two watchdogs, because mlx.distributed.init waits for its peers holding the
GIL: a Python thread names the stage and exits where it can run; faulthandler's
C thread, which needs no GIL, dumps every thread's stack and exits 1 a moment
later where it cannot (each stage is logged as it starts, so the log still
tells which).
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
from collections.abc import Callable

from engine.engine_thread import exit_now

log = logging.getLogger("kvwarm.distributed")
# how much later than the Python watchdog the GIL-free one fires
BACKSTOP_S = 2.0


class BootDeadline:
    """Started before joining the group; ``done`` once this rank is ready (and
    whenever its start ends otherwise: nothing may stay armed after)."""

    def __init__(self, expire: Callable[[int], None] = exit_now, backstop: bool = True):
        self.limit_s = 0.0  # 0: no limit (or not started)
        self._expire = expire  # an exit: the thread that hangs is in a collective
        self._backstop = backstop
        self._armed = False  # faulthandler's watchdog, process-wide
        self._stage = "starting"
        self._done = threading.Event()

    def start(self, limit_s: float) -> None:
        if limit_s <= 0 or self._done.is_set():
            return
        self.limit_s = limit_s
        threading.Thread(target=self._watch, name="kvwarm-boot-deadline", daemon=True).start()
        fd = _stderr_fd() if self._backstop else None
        if fd is not None:
            faulthandler.dump_traceback_later(limit_s + BACKSTOP_S, exit=True, file=fd)
            self._armed = True

    def stage(self, what: str) -> None:
        """What this rank does now: logged, and named should it never finish."""
        self._stage = what
        if self.limit_s > 0 and not self._done.is_set():
            log.info("start-up: %s", what)

    def done(self) -> None:
        self._done.set()
        if self._armed:
            self._armed = False
            faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        if self._done.wait(self.limit_s):
            return
        log.error(
            "the distributed group did not come up within %.0f s (--distributed-boot-timeout); "
            "this rank was %s: a rank is missing, hangs, or was started with another world "
            "size or hosts. Exiting",
            self.limit_s,
            self._stage,
        )
        self._expire(1)


def _stderr_fd() -> int | None:
    """Where the GIL-free watchdog writes: stderr's descriptor, if it has one (a
    captured or replaced stderr may not; then only the Python watchdog runs)."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            return stream.fileno() if stream is not None else None
        except (AttributeError, OSError, ValueError):
            continue
    return None
