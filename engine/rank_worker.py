"""A worker rank's process: its shard of the model, no HTTP, the serving rank's ops."""

from __future__ import annotations

import logging
import threading

from engine.distributed_config import server_host
from engine.engine_thread import EngineConfig, exit_now
from engine.lockstep import Follower

log = logging.getLogger("kvwarm.distributed")
# after the serving rank's connection ends, how long an orderly stop may take to
# arrive as a tick before this rank counts the serving rank as lost
STOP_GRACE_S = 3.0


def run_worker(config: EngineConfig) -> int:
    """Boot this rank (the same collectives as the serving rank, in the same order),
    then replay the serving rank's ops until it says stop. Non-zero: the group broke."""
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
    heartbeat.start()
    log.info("rank %d ready: following rank %d", group.rank, group.server_rank)
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
