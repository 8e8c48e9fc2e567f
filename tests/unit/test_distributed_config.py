"""Joining a group from flags or env (the Kamiwaza seed's way), without mlx.launch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.settings import Settings
from engine.distributed_config import DistributedConfig, server_host, write_hostfile


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables, and whatever write_hostfile sets is undone afterwards."""
    for name in (
        "MLX_RANK",
        "MLX_HOSTFILE",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "RANK",
        "WORLD_SIZE",
        "PAIRED_HOST",
    ):
        monkeypatch.setenv(name, "")  # undone last: the variable ends as it began
        monkeypatch.delenv(name)
    return monkeypatch


def test_alone_unless_asked_or_launched(clean_env):
    assert Settings(_env_file=None).distributed_config is None
    clean_env.setenv("MLX_RANK", "1")  # mlx.launch started this process
    assert Settings(_env_file=None).distributed_config is not None


def test_no_distributed_serves_alone_under_a_launchers_variable(clean_env):
    """Slurm's or MPICH's PMI_RANK, set for another reason, forced a group that
    --no-distributed (meant to undo the environment) could not turn off."""
    clean_env.setenv("PMI_RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    assert Settings(_env_file=None, distributed=False).distributed_config is None
    with pytest.raises(ValueError, match="a group has 2"):
        Settings(_env_file=None)  # unset: the launcher's variable says a group


def test_flags_write_the_hostfile_mlx_launch_would(clean_env, tmp_path):
    settings = Settings(
        _env_file=None,
        distributed=True,
        distributed_rank=1,
        distributed_world_size=2,
        distributed_hosts="10.0.0.1, 10.0.0.2",
        distributed_port=40000,
    )
    config = settings.distributed_config
    assert config.backend == "ring" and config.hosts == ("10.0.0.1", "10.0.0.2")
    write_hostfile(config)
    import os

    assert os.environ["MLX_RANK"] == "1"
    with open(os.environ["MLX_HOSTFILE"]) as f:
        assert json.load(f) == [["10.0.0.1:40000"], ["10.0.0.2:40001"]]
    assert server_host(0) == "10.0.0.1" and server_host(1) == "10.0.0.2"
    clean_env.delenv("MLX_HOSTFILE")
    clean_env.setenv("MLX_JACCL_COORDINATOR", "10.0.0.9:5000")  # mlx.launch --backend jaccl
    assert server_host(0) == "10.0.0.9"
    assert server_host(1, ("a", "b")) == "b"  # --distributed-hosts says it outright


def test_restarting_a_rank_reuses_its_hostfile(clean_env, tmp_path):
    """A rank restarted by its supervisor while it waits for a peer (every ~35 s)
    left one more /tmp/kvwarm-hosts-*.json each time."""
    import tempfile

    clean_env.setattr(tempfile, "tempdir", str(tmp_path))
    config = DistributedConfig(rank=0, world_size=2, port=41000)
    for _ in range(3):
        write_hostfile(config)
    assert [p.name for p in tmp_path.iterdir()] == [Path(os.environ["MLX_HOSTFILE"]).name]


def test_plain_rank_and_world_size_env_vars_work(clean_env):
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "2")
    config = Settings(_env_file=None, distributed=True).distributed_config
    assert (config.rank, config.world_size) == (0, 2)
    write_hostfile(config)  # one host for all: loopback
    assert server_host(0) == "127.0.0.1"


def test_the_seed_variables_work_from_a_dot_env_file_too(clean_env, tmp_path):
    """RANK / WORLD_SIZE were read from the process environment only; PAIRED_HOST
    was dropped, and each machine's ranks silently sat on loopback."""
    env = tmp_path / ".env"
    env.write_text("KVWARM_DISTRIBUTED=1\nRANK=1\nWORLD_SIZE=2\n")
    config = Settings(_env_file=env).distributed_config
    assert (config.rank, config.world_size) == (1, 2)
    env.write_text(env.read_text() + "PAIRED_HOST=10.0.0.1\n")
    with pytest.raises(ValueError, match="PAIRED_HOST=10.0.0.1 is set.*--distributed-hosts"):
        Settings(_env_file=env)
    hosts = Settings(_env_file=env, distributed_hosts="10.0.0.1,10.0.0.2").distributed_config
    assert hosts.hosts == ("10.0.0.1", "10.0.0.2")
    clean_env.setenv("RANK", "worker-3")  # another tool's variable: not ours to refuse
    assert Settings(_env_file=None).distributed_rank is None
    clean_env.setenv("WORLD_SIZE", "1")  # a launcher's single process: not distributed
    assert Settings(_env_file=None).distributed_config is None
    with pytest.raises(ValueError, match="2 ranks or more"):
        Settings(_env_file=None, distributed=True)


@pytest.mark.parametrize(
    "config, message",
    [
        (DistributedConfig(rank=None, world_size=2), "needs --distributed-rank"),
        (DistributedConfig(rank=2, world_size=2), "outside 0..1"),
        (DistributedConfig(rank=0, world_size=3, hosts=("a", "b")), "2 hosts for 3 ranks"),
    ],
)
def test_incomplete_settings_are_refused_naming_the_flag(clean_env, config, message):
    with pytest.raises(ValueError, match=message):
        write_hostfile(config)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="distributed-mode"):
        DistributedConfig(mode="expert")
    with pytest.raises(ValueError):
        Settings(_env_file=None, distributed_mode="expert")


def test_ranks_sharing_a_machine_share_its_blas_threads(clean_env, tmp_path):
    from engine.distributed_config import ranks_on_this_host, share_cpu_threads

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.1:1"], ["10.0.0.1:2"], ["10.0.0.2:3"]]))
    clean_env.setenv("MLX_HOSTFILE", str(hostfile))
    clean_env.setenv("MLX_RANK", "1")
    assert ranks_on_this_host(DistributedConfig()) == 2
    clean_env.setenv("MLX_RANK", "2")
    assert ranks_on_this_host(DistributedConfig()) == 1
    clean_env.delenv("MLX_RANK")
    clean_env.delenv("MLX_HOSTFILE")
    loopback = DistributedConfig(rank=0, world_size=2)
    clean_env.setenv("OPENBLAS_NUM_THREADS", "")
    clean_env.delenv("OPENBLAS_NUM_THREADS")
    clean_env.setattr("os.cpu_count", lambda: 8)
    assert share_cpu_threads(loopback) == "2 ranks on this machine: OPENBLAS_NUM_THREADS=4 each"
    import os

    assert os.environ["OPENBLAS_NUM_THREADS"] == "4"
    assert share_cpu_threads(loopback) is None  # the user's (or an earlier) setting wins
    two_macs = DistributedConfig(rank=0, world_size=2, hosts=("mac1", "mac2"))
    assert ranks_on_this_host(two_macs) == 1


def test_a_rank_timeout_under_a_second_is_refused():
    """Heartbeats go out every 50 ms at most: a 0.04 s timeout counted a healthy,
    idle group's worker as lost on both sides."""
    from pydantic import ValidationError

    from app.settings import Settings

    with pytest.raises(ValidationError, match="rank_timeout"):
        Settings(_env_file=None, rank_timeout=0.04)
    assert Settings(_env_file=None, rank_timeout=1).rank_timeout == 1


@pytest.mark.parametrize("hosts", ["10.0.0.1:5000", "::1", "10.0.0.1,fe80::1", "a b"])
def test_distributed_hosts_with_a_port_or_an_ipv6_address_are_refused(hosts):
    """They became "10.0.0.1:5000:39991" in the hostfile: MLX's ring could not parse
    it, which read as "peers not up" (exit 1) and a supervisor restarted it for ever."""
    from pydantic import ValidationError

    from app.settings import Settings

    with pytest.raises(ValidationError, match="distributed_hosts"):
        Settings(_env_file=None, distributed_hosts=hosts)
    assert Settings(_env_file=None, distributed_hosts="10.0.0.1, mac2.local").distributed_hosts


def test_the_heartbeat_listens_on_the_first_port_after_the_rings(clean_env, tmp_path):
    """It listened on a random port: a firewall opening only the documented ring
    ports (--distributed-port + r) kept every worker from its heartbeat."""
    import tempfile

    from engine.distributed_config import heartbeat_port

    clean_env.setattr(tempfile, "tempdir", str(tmp_path))
    config = DistributedConfig(rank=1, world_size=3, hosts=("10.0.0.1",), port=40000)
    assert heartbeat_port(config, 3) == 40003  # no hostfile yet (mpirun writes none)
    write_hostfile(config)  # a rank started by flags, as it joins
    assert heartbeat_port(config, 3) == 40003
    # mlx.launch --starting-port 5000 --connections-per-ip 2: a port per rank and connection
    ring = [[f"10.0.0.{r}:{5000 + 2 * r}", f"10.0.0.{r}:{5001 + 2 * r}"] for r in range(3)]
    (tmp_path / "launch.json").write_text(json.dumps(ring))
    clean_env.setenv("MLX_HOSTFILE", str(tmp_path / "launch.json"))
    assert heartbeat_port(DistributedConfig(), 3) == 5006
    jaccl = [{"ssh": "mac1", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en5"]}]
    (tmp_path / "launch.json").write_text(json.dumps(jaccl))  # names no port
    assert heartbeat_port(DistributedConfig(port=32323), 2) == 32325


def test_a_groups_boot_takes_its_heartbeat_port_from_the_settings(clean_env):
    from types import SimpleNamespace

    from engine.boot import _group_boot

    config = SimpleNamespace(
        group=SimpleNamespace(size=3), distributed=DistributedConfig(port=40000)
    )
    assert _group_boot(config).monitor_port == 40003  # type: ignore[arg-type, union-attr]
