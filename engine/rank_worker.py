"""A worker rank's process: its shard of the model, no HTTP, the serving rank's ops."""

from __future__ import annotations

import logging
import os
import signal
import threading

from engine.distributed_config import server_host
from engine.engine_thread import EngineConfig, exit_now
from engine.lockstep import Follower

log = logging.getLogger("kvwarm.distributed")
# after the serving rank's connection ends, how long an orderly stop may take to
# arrive as a tick before this rank counts the serving rank as lost
STOP_GRACE_S = 3.0


def stop_limit(drain_s: float, rank_timeout_s: float) -> float:
    """How long a worker follows the serving rank after a stop signal before it gives
    up: ``drain_s``, then the stop's way here and a rank timeout's slack for the step
    the serving rank had in flight."""
    return drain_s + STOP_GRACE_S + rank_timeout_s


def follow_through_stop_signals(limit_s: float, stopped: threading.Event) -> None:
    """SIGTERM / SIGINT reach every rank when a supervisor or mlx.launch stops the
    group: a worker that left at once broke the serving rank's drain (every running
    stream failed as a lost rank). It follows on until the serving rank's stop, at
    most ``limit_s``; a second signal ends it at once.

    Watched from a thread through the wakeup fd, not a Python handler: those run on
    the main thread only, which an idle group keeps blocked in a collective for as
    long as nothing is sent (a stop then waited for the supervisor's SIGKILL)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    watched = {int(signal.SIGINT), int(signal.SIGTERM)}
    for signum in watched:
        signal.signal(signum, lambda *_: None)  # the watcher acts; no KeyboardInterrupt

    def give_up(signum: int) -> None:
        if not stopped.wait(limit_s):
            log.error("the serving rank did not stop within %.0f s; exiting", limit_s)
            exit_now(128 + signum)

    def watch() -> None:
        received = 0
        while True:
            for signum in os.read(read_end, 64):
                if signum not in watched:
                    continue
                received += 1
                if received > 1:
                    exit_now(128 + signum)
                log.warning(
                    "%s: following the serving rank while it drains "
                    "(at most %.0f s; again to quit now)",
                    signal.Signals(signum).name,
                    limit_s,
                )
                threading.Thread(target=give_up, args=(signum,), daemon=True).start()

    threading.Thread(target=watch, name="kvwarm-stop-signals", daemon=True).start()


def run_worker(config: EngineConfig, drain_s: float) -> int:
    """Boot this rank (the same collectives as the serving rank, in the same order),
    then replay the serving rank's ops until it says stop (``drain_s``: the longest
    the serving rank takes from a stop signal to its stop, app.lifecycle.stopping_s).
    Non-zero: the group broke."""
    from engine.boot import boot_mlx  # mlx: this thread owns it in a worker process
    from engine.rank_health import Heartbeat

    group, dist = config.group, config.distributed
    assert group is not None and dist is not None
    booted = boot_mlx(config)
    ranks = booted.group
    done = threading.Event()

    def lost(reason: str) -> None:
        if done.wait(STOP_GRACE_S):
            return
        log.error("rank %d: %s; exiting", group.rank, reason)
        exit_now(1)

    # where the launcher says the serving rank is, then every address its machine has
    # (mpirun writes no hostfile; JACCL names only rank 0's coordinator)
    known = server_host(group.server_rank, dist.hosts)
    heartbeat = Heartbeat(
        [known, *ranks.monitor_hosts],
        ranks.heartbeat_to,
        group.rank,
        dist.rank_timeout_s,
        lost,
        token=ranks.monitor_token,
    )
    group.boot.stage("connecting to the serving rank's monitor")
    heartbeat.start()
    group.boot.done()
    log.info("rank %d ready: following rank %d", group.rank, group.server_rank)
    follow_through_stop_signals(stop_limit(drain_s, dist.rank_timeout_s), done)
    follower = Follower(booted.runner, lambda: group.broadcast(None), ranks.clock)
    try:
        follower.run()
    except Exception:
        log.exception("rank %d: the group cannot go on", group.rank)
        exit_now(1)
    done.set()
    heartbeat.stop()
    booted.runner.close()
    log.info("rank %d stopped with the serving rank after %d steps", group.rank, follower.ticks)
    return 0
