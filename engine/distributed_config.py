"""How this process joins a distributed group: settings and the launch
environment (no mlx here: the HTTP side reads it before the engine starts)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

MODES = ("auto", "tensor", "pipeline")
_LAUNCHER_RANK_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


@dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a group (``kvwarm serve --distributed``...)."""

    mode: str = "auto"  # tensor | pipeline | auto (tensor where the model can)
    server_rank: int = 0  # the rank that serves HTTP and decides every step
    backend: str = "any"  # mlx.distributed backend: any, ring, jaccl, mpi
    rank_timeout_s: float = 10.0  # heartbeats missed this long: the rank is lost
    boot_timeout_s: float = 1800.0  # the group not up by then: exit (0: wait for ever)
    # set without mlx.launch (the Kamiwaza seed's RANK / WORLD_SIZE / PAIRED_HOST):
    rank: int | None = None
    world_size: int | None = None
    hosts: tuple[str, ...] = ()  # each rank's address, in rank order
    port: int = 32323  # rank r listens on port + r (ring); the heartbeat on port + size

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--distributed-mode must be one of {', '.join(MODES)}")


def launched() -> bool:
    """Whether a launcher (mlx.launch, mpirun) started this process as a rank."""
    return any(v in os.environ for v in _LAUNCHER_RANK_VARS)


def write_hostfile(config: DistributedConfig) -> None:
    """Set up a ring group from flags alone: every rank writes the same hostfile
    (rank r at hosts[r]:port+r) and names its own rank, as mlx.launch would."""
    if config.rank is None or config.world_size is None:
        raise ValueError(
            "--distributed without mlx.launch needs --distributed-rank and --distributed-world-size"
        )
    size = config.world_size
    if not 0 <= config.rank < size:
        raise ValueError(f"--distributed-rank {config.rank} is outside 0..{size - 1}")
    hosts = _rank_hosts(config.hosts, size)
    if len(hosts) != size:
        raise ValueError(f"--distributed-hosts names {len(hosts)} hosts for {size} ranks")
    entries = [[f"{h}:{config.port + r}"] for r, h in enumerate(hosts)]
    # one file per group port and rank, replaced at each start: a rank restarted by
    # its supervisor (waiting for a peer) left a new temp file every time
    path = hostfile_path(config.port, config.rank)
    fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(entries, f)
    os.replace(tmp, path)
    os.environ["MLX_HOSTFILE"] = str(path)
    os.environ["MLX_RANK"] = str(config.rank)


def hostfile_path(port: int, rank: int) -> Path:
    return Path(tempfile.gettempdir()) / f"kvwarm-hosts-{os.getuid()}-{port}-r{rank}.json"


def _rank_hosts(hosts: tuple[str, ...], size: int) -> list[str]:
    """--distributed-hosts per rank: none means loopback, one address serves every rank."""
    listed = list(hosts) or ["127.0.0.1"]
    return listed * size if len(listed) == 1 else listed


def _hostfile_hosts() -> list[str] | None:
    """Each rank's host in the hostfile mlx.launch (or write_hostfile) wrote; None: no
    readable hostfile. Ring entries are ["ip:port", ...]; launcher entries {"ips": [...]}."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return None
    try:
        with open(path) as f:
            entries = json.load(f)
        return [_host(e[0] if isinstance(e, list) else e.get("ips", [""])[0]) for e in entries]
    except (OSError, ValueError, IndexError, KeyError, AttributeError, TypeError):
        return None


def heartbeat_port(config: DistributedConfig, size: int) -> int:
    """The port the serving rank's heartbeat monitor listens on: the first after the
    ring's, so one firewall rule opens a run of ports. --distributed-port + the world
    size; under mlx.launch, one past the highest port its ring hostfile names (its
    --starting-port counts one per rank, address and connection)."""
    ring = _hostfile_ports()
    return max(ring) + 1 if ring else config.port + size


def _hostfile_ports() -> list[int]:
    """Every port a ring hostfile (mlx.launch's, or write_hostfile's) names; none for
    another launcher's file (JACCL's, mpirun's) or none at all."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return []
    try:
        with open(path) as f:
            entries = json.load(f)
        return [
            int(address.rsplit(":", 1)[1])
            for entry in entries
            if isinstance(entry, list)
            for address in entry
            if isinstance(address, str) and ":" in address
        ]
    except (OSError, ValueError, TypeError):
        return []


def server_host(server_rank: int, hosts: tuple[str, ...] = ()) -> str:
    """The serving rank's address, for the heartbeat: --distributed-hosts, else the
    ring hostfile mlx.launch wrote, else JACCL's coordinator (rank 0), else loopback."""
    if len(hosts) > server_rank:
        return hosts[server_rank]
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator and server_rank == 0:
        return _host(coordinator)
    listed = _hostfile_hosts()
    if listed is not None and server_rank < len(listed) and listed[server_rank]:
        return listed[server_rank]
    return "127.0.0.1"


def ranks_on_this_host(config: DistributedConfig) -> int:
    """How many ranks of the group share this machine (they then share its cores)."""
    if launched() and os.environ.get("MLX_HOSTFILE"):
        listed = _hostfile_hosts()
        rank = os.environ.get("MLX_RANK", "0")
        if listed is None or not rank.isdigit() or int(rank) >= len(listed):
            return 1
        return listed.count(listed[int(rank)])
    if config.world_size is None or config.rank is None:
        return 1
    hosts = _rank_hosts(config.hosts, config.world_size)
    return hosts.count(hosts[min(config.rank, len(hosts) - 1)])


def share_cpu_threads(config: DistributedConfig) -> str | None:
    """Ranks sharing one machine's CPU each take their share of its BLAS threads
    (each rank's OpenBLAS would otherwise start a thread per core and the ranks,
    which meet at every collective, would spin against each other). Must run
    before BLAS loads; returns what it set, or None."""
    local = ranks_on_this_host(config)
    if local < 2 or "OPENBLAS_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in os.environ:
        return None
    threads = max(1, (os.cpu_count() or 1) // local)
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    return f"{local} ranks on this machine: OPENBLAS_NUM_THREADS={threads} each"


def _host(address: object) -> str:
    text = str(address)
    return text.rsplit(":", 1)[0] if ":" in text else text
