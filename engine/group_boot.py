"""What bringing an engine up adds on a distributed group (engine.boot calls it
on every rank, in the same order, so each collective here meets its peers)."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any

import mlx.core as mx

from engine import group_wire
from engine.distributed import RankGroup
from engine.lockstep import LeaderRunner, TickClock
from engine.model_shards import shard_model
from engine.rank_health import RankMonitor, own_addresses
from kvcache.layout import KVLayout, layout_multiples
from scheduler.admission import MemoryBudget

log = logging.getLogger("kvwarm.distributed")


def software_versions() -> str:
    """The versions of what a rank runs that its group must share."""
    found = []
    for name in ("kvwarm", "mlx", "mlx-lm"):
        try:
            found.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name}=?")
    return " ".join(found)


@dataclass
class GroupBoot:
    group: RankGroup
    mode: str  # tensor | pipeline | auto (until the model is sharded)
    timeout_s: float
    clock: TickClock
    used: str = ""  # the mode the model was split with
    monitor: RankMonitor | None = None  # the serving rank's, once it leads
    heartbeat_to: int = 0  # a worker's: the port the serving rank's monitor listens on
    monitor_token: str = ""  # and what that monitor answers a hello with
    monitor_hosts: tuple[str, ...] = ()  # the serving machine's addresses, loopback last
    monitor_port: int = 0  # the serving rank's: where it listens (0: any free port)

    def check_same(self, fingerprint: str, settings: str) -> None:
        """Ranks refuse to start against other model files, engine settings or
        software: another mlx-lm may shard (and so communicate) otherwise, another
        kvwarm send ticks of another form; found only later, or as a hang."""
        self.group.boot.stage("agreeing with the other ranks on software, model files and settings")
        self.group.agree("the software", software_versions())
        self.group.agree("the model files (config + weights fingerprint)", fingerprint)
        self.group.agree("the engine settings", settings)
        self.group.boot.stage("loading its shard of the model")

    def shard(self, model: Any) -> None:
        self.used = shard_model(model, self.group.group, self.mode)
        log.info(
            "rank %d/%d: %s parallel (%s)",
            self.group.rank,
            self.group.size,
            self.used,
            "serves HTTP" if self.group.serving else "follows the serving rank",
        )

    def heads_per_rank(self, heads: int) -> int:
        """Attention heads this rank computes: tensor parallel splits every layer's
        heads over the ranks (mlx-lm's shard leaves ``args`` whole); pipeline
        parallel runs all heads of its layers."""
        return heads // self.group.size if self.used == "tensor" else heads

    def tightest(self, budget: MemoryBudget) -> tuple[MemoryBudget, int]:
        """The budget admission enforces (the rank with the least room for KV decides:
        every rank holds every row's shard) and this rank's prompt cache size.

        Every rank's cache must take the same decisions (hits, entry ids, evictions),
        yet each measures an entry by its own layers. When each rank's shard is n
        copies of one mix of cache layers, its entries cost exactly n times the mix's:
        caches of n times one size then decide alike. Shards of other mixes (pipeline
        slices of a hybrid model) would not, and the group stopped at the first hit
        that disagreed: the prompt cache is off on such a group."""
        self.group.boot.stage("sharing its memory budget with the other ranks")
        shares = [group_wire.loads(b) for b in self.group.gather(group_wire.dumps(budget))]
        layouts = [s.layout or KVLayout.attention_only(s.kv_bytes_per_token) for s in shares]
        multiples = layout_multiples(layouts)
        if multiples is None:
            if any(s.prompt_cache_bytes for s in shares):
                log.warning(
                    "the ranks' shards hold different mixes of cache layers (%s): their "
                    "prefix caches would keep different entries, so the prompt cache is off "
                    "on this group (its memory goes to requests)",
                    "; ".join(f"rank {r}: {lay.describe()}" for r, lay in enumerate(layouts)),
                )
            shares = [replace(s, prompt_cache_bytes=0) for s in shares]
            budget, cache_bytes = replace(budget, prompt_cache_bytes=0), 0
        else:  # the most each rank's own share allows, in units of the mix
            unit = min(s.prompt_cache_bytes // n for s, n in zip(shares, multiples))
            cache_bytes = unit * multiples[self.group.rank]
        tight = min(shares, key=lambda s: (s.ceiling_tokens, s.kv_budget_bytes))
        self.group.boot.stage("building its engine")
        if self.group.serving:
            budget = replace(tight, source=f"{tight.source}, tightest of {self.group.size} ranks")
        return budget, cache_bytes

    def same_randomness(self) -> None:
        """Unseeded sampling draws from the global generator: the same on every rank."""
        seed = secrets.randbits(32) if self.group.serving else 0
        data = self.group.broadcast(seed.to_bytes(4, "little") if self.group.serving else None)
        mx.random.seed(int.from_bytes(data, "little"))

    def lead(self, runner: Any) -> tuple[LeaderRunner, RankMonitor]:
        """The serving rank: a monitor for the workers' heartbeats, and the runner
        that sends each step's ops to them."""
        self.group.boot.stage("waiting for every worker's heartbeat connection")
        workers = [r for r in range(self.group.size) if r != self.group.rank]
        monitor = RankMonitor(workers, self.timeout_s, port=self.monitor_port)
        monitor.listen()
        log.info("heartbeat monitor listening on port %d for ranks %s", monitor.port, workers)
        where = f"{monitor.port} {monitor.token} {','.join(own_addresses())}"
        self.group.broadcast(where.encode())
        # ready only once every worker is booted and beating (each connects as its
        # last step of booting): a rank lost later is then always a loss, never "late"
        monitor.wait_connected()
        self.group.boot.done()
        self.monitor = monitor
        return LeaderRunner(runner, self.group.broadcast, self.clock, monitor.step_running), monitor

    def follow(self) -> None:
        """A worker: learn where the serving rank's monitor listens."""
        self.group.boot.stage("waiting for the serving rank's start-up")
        port, token, hosts = self.group.broadcast(None).decode().split(" ")
        self.heartbeat_to, self.monitor_token = int(port), token
        self.monitor_hosts = tuple(h for h in hosts.split(",") if h)
